"""The GRPO loop on the tiny model: metrics, updates, config errors, resume, DeepSpeed."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from pydantic import ValidationError
from tests_helpers_trainer import (
    grpo_cli_args,
    grpo_step_lines,
    recipe_paths,
    small_grpo_config,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.torchrun import torchrun_command
from core.seeds import group_seeds
from trainer.grpo.config import GRPOConfig, RolloutConfig
from trainer.grpo.prompts import load_prompts
from trainer.grpo.recipe import run_grpo
from trainer.grpo.rollout import HFRolloutEngine, cut_at_stop
from trainer.metrics import read_metrics

SMALL = small_grpo_config(
    max_steps=3,
    eval_every=3,
    checkpoint_every=0,
    optim={"learning_rate": 1e-3, "lr_scheduler": "constant"},
)
REQUIRED = {
    "step",
    "max_steps",
    "epoch",
    "wall_time_s",
    "loss",
    "learning_rate",
    "grad_norm",
    "entropy",
    "kl",
    "mean_reward",
    "answer_language_accuracy",
    "reasoning_language_accuracy",
    "response_length_mean",
    "clip_fraction",
    "rollout_time_s",
    "train_time_s",
    "tokens_per_s",
}


def _run(tmp_path, model, data, **overrides):
    cfg = GRPOConfig.model_validate({**SMALL, **overrides})
    return run_grpo(cfg, *recipe_paths(model, data, tmp_path))


def test_grpo_steps_write_every_metric_and_export_a_loadable_policy(
    tmp_path, tiny_model_dir, prepared_data
):
    result = _run(tmp_path, tiny_model_dir, prepared_data)
    lines = read_metrics(result.metrics_file)
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert set(m) >= REQUIRED, REQUIRED - set(m)
        assert -9.5 <= m["mean_reward"] <= 7.0 and m["max_steps"] == 3
    evals = [m for m in lines if "eval_mean_reward" in m]
    assert [m["step"] for m in evals] == [0, 3]  # the SFT baseline, then the end
    assert {"eval_real_word_share", "eval_answer_language_accuracy"} <= set(evals[0])
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "work" / "final_policy").state_dict()
    assert any(not torch.equal(before[k], final[k]) for k in before)  # it updated
    AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert result.exported_step in (0, 3)


def test_several_ppo_epochs_and_kl_to_the_reference(tmp_path, tiny_model_dir, prepared_data):
    result = _run(
        tmp_path,
        tiny_model_dir,
        prepared_data,
        algorithm={"ppo_epochs": 2, "kl_loss_coef": 0.1, "filter_no_signal_groups": False},
        mini_batch_size=8,
        micro_batch_size=4,
        max_steps=2,
        eval_every=0,
    )
    steps = [m for m in read_metrics(result.metrics_file) if "loss" in m]
    assert len(steps) == 2
    # the second epoch and second mini-batch update a policy that moved: KL > 0
    assert steps[-1]["kl"] > 0


@pytest.mark.parametrize(
    "algorithm",
    [
        {"policy_loss": "gspo", "clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004},
        {
            "advantage_estimator": "dr_grpo",
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "overlong_buffer": 8,
        },
    ],
    ids=["gspo", "dr_grpo+overlong"],
)
def test_each_loss_variant_trains_on_the_torch_backend(
    tmp_path, tiny_model_dir, prepared_data, algorithm
):
    """Issue #43: a tiny run of each variant updates the policy and logs every metric."""
    result = _run(tmp_path, tiny_model_dir, prepared_data, algorithm=algorithm, eval_every=0)
    steps = [m for m in read_metrics(result.metrics_file) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(set(m) >= REQUIRED and torch.isfinite(torch.tensor(m["loss"])) for m in steps)
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "work" / "final_policy").state_dict()
    assert any(not torch.equal(before[k], final[k]) for k in before)


def test_dynamic_sampling_refills_the_batch_on_the_torch_backend(
    tmp_path, tiny_model_dir, prepared_data
):
    """Issue #43: DAPO's dynamic sampling in the loop every backend shares (Megatron's too:
    ``run_grpo`` drives each through the same producer and ``fill_signal_groups``); its
    counts agree with the batch that was trained on."""
    ds = {"dynamic_sampling": {"enabled": True, "max_resample_rounds": 2}}
    result = _run(tmp_path, tiny_model_dir, prepared_data, algorithm=ds, max_steps=2, eval_every=0)
    steps = [m for m in read_metrics(result.metrics_file) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    groups = SMALL["prompts_per_step"]
    # the tiny model's groups often score alike (3 of step 1's 4 here): rounds refill them
    assert sum(m["dynamic_sampling/refilled_groups"] for m in steps) > 0
    for m in steps:
        assert set(m) >= REQUIRED
        rounds, unfilled = m["dynamic_sampling/rounds"], m["dynamic_sampling/unfilled_groups"]
        assert rounds in (0, 1, 2)
        assert m["dynamic_sampling/sampled_groups"] == groups * (1 + rounds)
        # the slots left without signal are the samples the update left out
        assert m["no_signal_fraction"] == pytest.approx(unfilled / groups)
        assert m["dynamic_sampling/signal_groups"] >= groups - unfilled
        assert m["dynamic_sampling/refilled_groups"] <= m["dynamic_sampling/signal_groups"]
        assert rounds == 2 or unfilled == 0  # it stops early only when every slot has signal
        assert m["dynamic_sampling/signal_rate"] == pytest.approx(
            m["dynamic_sampling/signal_groups"] / m["dynamic_sampling/sampled_groups"]
        )


@pytest.mark.slow
def test_gspo_on_deepspeed_zero3_two_processes(tmp_path, tiny_model_dir, prepared_data):
    pytest.importorskip("deepspeed")
    cfg = {
        **SMALL,
        "nproc": 2,
        "micro_batch_size": 4,
        "max_steps": 2,
        "eval_every": 0,
        "algorithm": {"policy_loss": "gspo", "overlong_buffer": 8},
        "optim": {**SMALL["optim"], "backend": "deepspeed", "zero_stage": 3},
    }
    args = grpo_cli_args(tmp_path, "ds", cfg, tiny_model_dir, prepared_data)
    subprocess.run(torchrun_command("trainer.grpo", args, 2), check=True)
    lines = read_metrics(tmp_path / "ds" / "work" / "training_metrics.jsonl")
    assert [m["step"] for m in lines if "loss" in m] == [1, 2]


def test_config_errors_are_raised_at_start():
    with pytest.raises(ValidationError, match="not a multiple of mini_batch_size"):
        GRPOConfig.model_validate({**SMALL, "mini_batch_size": 5})
    with pytest.raises(ValidationError, match="micro_batch_size"):
        GRPOConfig.model_validate({**SMALL, "micro_batch_size": 3})
    with pytest.raises(ValidationError, match="loss_agg_mode"):
        GRPOConfig.model_validate({**SMALL, "algorithm": {"loss_agg_mode": "mean-of-everything"}})
    with pytest.raises(ValidationError, match="tis_cap"):
        GRPOConfig.model_validate({**SMALL, "algorithm": {"tis_cap": 1.0}})
    with pytest.raises(ValidationError, match="nproc"):
        GRPOConfig.model_validate(
            {**SMALL, "prompts_per_step": 3, "rollout": {"n_samples": 16}, "nproc": 2}
        )


def test_prompts_longer_than_the_limit_are_dropped_or_fail(tiny_model_dir, prepared_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(prepared_data / "train.jsonl", tokenizer, 4096)
    lengths = sorted(len(p.ids) for p in prompts)
    fewer = load_prompts(prepared_data / "train.jsonl", tokenizer, lengths[len(lengths) // 2])
    assert 0 < len(fewer) < len(prompts)
    assert len({p.text for p in prompts}) == len(prompts)  # unique prompts
    with pytest.raises(ValueError, match="raise rollout.max_prompt_tokens"):
        load_prompts(prepared_data / "train.jsonl", tokenizer, 8)


def test_an_unreadable_label_fails_at_load_naming_its_line(tmp_path, tiny_model_dir, prepared_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = (prepared_data / "train.jsonl").read_text().splitlines()[:3]
    bad = json.loads(rows[2])
    bad["label"] = "fr/klingon"
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([*rows[:2], json.dumps(bad)]) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:3: label 'fr/klingon'"):
        load_prompts(path, tokenizer, 4096)


def test_hf_engine_groups_samples_and_stops_at_return(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(max_new_tokens=6))
    prompts = [
        tokenizer("<|start|>user<|message|>Hallo<|end|><|start|>assistant")["input_ids"],
        [5, 6, 7],
    ]
    seeds = group_seeds(1, 0, [0, 1], 3)
    out = engine.generate(prompts, seeds)
    assert [r.prompt_index for r in out] == [0, 0, 0, 1, 1, 1]
    assert all(1 <= len(r.response_ids) <= 6 for r in out)
    assert out == engine.generate(prompts, seeds)  # seeded
    with pytest.raises(ValueError, match="same number"):
        engine.generate(prompts, [[1, 2], [3]])
    ret = tokenizer.convert_tokens_to_ids("<|return|>")
    assert cut_at_stop([9, 9, ret, 9], {ret}, 0) == ([9, 9, ret], True)
    assert cut_at_stop([9, 9, 0, 0], {ret}, 0) == ([9, 9], False)


def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir, prepared_data):
    """Killed after step 3 (its checkpoint is step 2's), resumed: steps 3-6 run again across
    an eval (step 4) and checkpoints that rotate step 2's out (max_ckpt_num 2), and every step
    matches the uninterrupted run's."""
    cfg = {**SMALL, "max_steps": 6, "checkpoint_every": 2, "eval_every": 4, "max_ckpt_num": 2}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.grpo",
            *grpo_cli_args(tmp_path, "whole", cfg, tiny_model_dir, prepared_data),
        ],
        check=True,
    )
    args = grpo_cli_args(tmp_path, "killed", cfg, tiny_model_dir, prepared_data)
    proc = subprocess.Popen([sys.executable, "-m", "trainer.grpo", *args])
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if len(grpo_step_lines(tmp_path, "killed")) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    subprocess.run([sys.executable, "-m", "trainer.grpo", *args], check=True)
    whole, resumed = grpo_step_lines(tmp_path, "whole"), grpo_step_lines(tmp_path, "killed")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(whole, resumed, strict=True):
        for key in ("loss", "mean_reward", "learning_rate", "response_length_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a["step"])


def test_deepspeed_zero3_two_processes(tmp_path, tiny_model_dir, prepared_data):
    pytest.importorskip("deepspeed")
    cfg = {
        **SMALL,
        "nproc": 2,
        "micro_batch_size": 4,
        "max_steps": 2,
        "eval_every": 2,
        "optim": {**SMALL["optim"], "backend": "deepspeed", "zero_stage": 3},
    }
    args = grpo_cli_args(tmp_path, "ds", cfg, tiny_model_dir, prepared_data)
    subprocess.run(torchrun_command("trainer.grpo", args, 2), check=True)
    lines = read_metrics(tmp_path / "ds" / "work" / "training_metrics.jsonl")
    assert [m["step"] for m in lines if "loss" in m] == [1, 2]  # rank 0 alone writes
    assert all(set(m) >= REQUIRED for m in lines if "loss" in m)
    AutoModelForCausalLM.from_pretrained(tmp_path / "ds" / "model")


def test_update_layout_log_probs_equal_unpadded_forwards(tiny_model_dir):
    """Rows right-aligned with left padding, and only the last logits kept, give the same
    response log-probs as a plain forward of each row alone."""
    from trainer.grpo import algorithm as algo
    from trainer.grpo.micro_batch import micro_log_probs, sequences
    from trainer.grpo.prompts import Prompt
    from trainer.grpo.rollout import Rollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [Prompt([5, 6, 7, 8, 9, 10, 11], "fr", "a"), Prompt([12, 13, 14], "de", "b")]
    rollouts = [Rollout(0, [20, 21, 22], True), Rollout(1, [30, 31, 32, 33, 34, 35], False)]
    layout = sequences(prompts, rollouts, pad_id=0, device="cpu")
    with torch.no_grad():
        batched, _ = micro_log_probs(model, layout, False)
        for row, rollout in enumerate(rollouts):
            ids = torch.tensor([prompts[rollout.prompt_index].ids + rollout.response_ids])
            logits = model(input_ids=ids).logits[:, :-1]
            alone = algo.token_log_probs(logits, ids[:, 1:])[0, -len(rollout.response_ids) :]
            got = batched[row][layout.mask[row] > 0]
            assert torch.allclose(got, alone, atol=1e-5), row


def test_shared_prefix_update_equals_full_rows_in_value_and_gradient(tiny_model_dir):
    """Rows of the same prompt run the prompt once and index its KV cache out to the group:
    the log-probs, entropies and parameter gradients equal those of the full rows. The prompts
    are longer than the tiny model's sliding window (32), so the windowed layers' cache crop
    is exercised; one response is empty and lengths differ."""
    from trainer.grpo import algorithm as algo
    from trainer.grpo.micro_batch import micro_log_probs, sequences
    from trainer.grpo.prompts import Prompt
    from trainer.grpo.rollout import Rollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    long_a = torch.randint(5, 900, (45,), generator=gen).tolist()
    long_b = torch.randint(5, 900, (38,), generator=gen).tolist()
    prompts = [Prompt(long_a, "fr", "a"), Prompt(long_b, "de", "b")]
    responses = [[20, 21, 22], [40, 41, 42, 43, 44], [], [30, 31, 32, 33, 34, 35], [50]]
    owners = [0, 0, 0, 1, 1]
    rollouts = [Rollout(o, r, True) for o, r in zip(owners, responses, strict=True)]
    layout = sequences(prompts, rollouts, pad_id=0, device="cpu")
    assert layout.shared is not None

    def run(shared: bool):
        model.zero_grad()
        micro = (
            layout
            if shared
            else type(layout)(layout.ids, layout.attention, layout.positions, layout.mask, None)
        )
        log_probs, entropy = micro_log_probs(model, micro, True)
        loss = algo.aggregate_loss(
            log_probs * torch.linspace(-1, 1, log_probs.shape[0])[:, None], layout.mask,
            "token-mean",
        )  # fmt: skip
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return log_probs.detach() * layout.mask, entropy.detach() * layout.mask, grads

    full_lp, full_ent, full_grads = run(shared=False)
    lp, ent, grads = run(shared=True)
    torch.testing.assert_close(lp, full_lp, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ent, full_ent, atol=2e-5, rtol=1e-4)
    assert grads.keys() == full_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], atol=1e-5, rtol=1e-3, msg=name)


def test_hf_engine_decode_loop_matches_greedy_generate(tiny_model_dir):
    """With top-p so small that only the top token survives, our decode loop (prefill once,
    cache copied to the samples, one forward per token) must give exactly HF's greedy
    ``generate`` — prompts longer than the sliding window, of unequal lengths."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(max_new_tokens=12, top_p=1e-6))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 900, (k,), generator=gen).tolist() for k in (40, 33, 9)]
    out = engine.generate(prompts, group_seeds(0, 0, range(3), 2))
    for rollout in out:
        prompt = torch.tensor([prompts[rollout.prompt_index]])
        greedy = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=sorted(engine.stop_ids),
            pad_token_id=engine.pad_id,
        )[0, prompt.shape[1] :].tolist()
        expected, finished = cut_at_stop(greedy, engine.stop_ids, engine.pad_id)
        assert (rollout.response_ids, rollout.finished) == (expected, finished)


def test_hf_engine_samples_from_the_tempered_nucleus(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(40_000, 1)
    torch.manual_seed(0)
    plain = HFRolloutEngine(model, tokenizer, RolloutConfig())._sample(logits)
    freq = torch.bincount(plain, minlength=4).float() / len(plain)
    assert torch.allclose(freq, probs, atol=0.01), freq
    nucleus = HFRolloutEngine(model, tokenizer, RolloutConfig(top_p=0.7))._sample(logits)
    freq = torch.bincount(nucleus, minlength=4).float() / len(nucleus)
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.01), freq
    hot = HFRolloutEngine(model, tokenizer, RolloutConfig(temperature=2.0))._sample(logits)
    tempered = probs.sqrt() / probs.sqrt().sum()
    freq = torch.bincount(hot, minlength=4).float() / len(hot)
    assert torch.allclose(freq, tempered, atol=0.01), freq
