"""Tempered log-probs (issue #43): rollouts sampled at ``rollout.temperature`` T are scored by
the trainer, recorded by the engines and compared under one policy, ``softmax(logits / T)``;
at T = 1 nothing changes, bit for bit; the weight-sync check stays on raw logits."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.seeds import group_seeds
from trainer.backends.torch import TorchBackend
from trainer.distributed import DistInfo
from trainer.grpo import algorithm as algo
from trainer.grpo import update
from trainer.grpo.config import GRPOConfig, RolloutConfig
from trainer.grpo.micro_batch import micro_log_probs, sequences
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import HFRolloutEngine, Rollout
from trainer.grpo.sync_check import SyncProbe, sync_probe
from trainer.grpo.vllm_rollout import vllm_engine_kwargs
from trainer.grpo.weight_sync import probe_gap

CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def _hand_log_softmax(row: list[float], temperature: float) -> list[float]:
    z = [v / temperature for v in row]
    norm = math.log(sum(math.exp(v) for v in z))
    return [v - norm for v in z]


def test_token_log_probs_and_entropy_at_a_temperature_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([0, 3])
    got = algo.token_log_probs(logits, targets, temperature=0.7)
    rows = [_hand_log_softmax(r, 0.7) for r in logits.tolist()]
    assert got.tolist() == pytest.approx([rows[0][0], rows[1][3]], abs=1e-12)
    entropy = algo.entropy_from_logits(logits, temperature=0.7)
    want = [-sum(math.exp(lp) * lp for lp in row) for row in rows]
    assert entropy.tolist() == pytest.approx(want, abs=1e-12)
    # sharper than the raw distribution: a lower entropy, the top token likelier
    assert (entropy < algo.entropy_from_logits(logits)).all()
    assert got[0] > algo.token_log_probs(logits, targets)[0]
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        algo.token_log_probs(logits, targets, temperature=0.0)


def test_at_temperature_one_the_log_probs_are_the_raw_formula_bit_for_bit():
    """The demo's default (T = 1) computes exactly what it computed before temperatures: the
    chosen logit minus the logsumexp of the float32 logits, no division anywhere."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
    before = chosen - torch.logsumexp(logits.float(), -1)
    assert torch.equal(algo.token_log_probs(logits, targets, chunk_rows=4), before)
    assert torch.equal(algo.token_log_probs(logits, targets, temperature=1.0), before)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """``(load, tokenizer)``: ``load()`` is a fresh float32 copy of the tiny model."""

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    return load, AutoTokenizer.from_pretrained(tiny_model_dir)


def _prompts(tokenizer) -> list[Prompt]:
    texts = ["Bonjour, ça va ?", "Wie spät ist es?"]
    return [
        Prompt(
            tokenizer(f"<|start|>user<|message|>{t}<|end|><|start|>assistant")["input_ids"],
            "fr/fr",
            t,
        )  # fmt: skip
        for t in texts
    ]


@pytest.mark.parametrize("shared", [True, False])
def test_the_trainer_s_log_probs_at_0_7_are_log_softmax_of_the_logits_over_0_7(tiny, shared):
    """Both layouts of the update's forward (the shared-prefix one, and full rows) score the
    response tokens under ``softmax(z / 0.7)`` of a plain forward's logits ``z``."""
    load, tokenizer = tiny
    model = load()
    prompts = _prompts(tokenizer)
    rollouts = [Rollout(0, [20, 21, 22], True), Rollout(0, [40, 41], True), Rollout(1, [30], False)]
    layout = sequences(prompts, rollouts, 0, "cpu", temperature=0.7)
    if not shared:
        layout.shared = None
    with torch.no_grad():
        got, entropy = micro_log_probs(model, layout, True)
        raw, _ = micro_log_probs(model, sequences(prompts, rollouts, 0, "cpu"), False)
    for row, rollout in enumerate(rollouts):
        ids = torch.tensor([prompts[rollout.prompt_index].ids + rollout.response_ids])
        with torch.no_grad():
            z = model(input_ids=ids).logits[0, :-1][-len(rollout.response_ids) :]
        targets = torch.tensor(rollout.response_ids)
        want = torch.log_softmax(z / 0.7, -1)[torch.arange(len(targets)), targets]
        kept = layout.mask[row] > 0
        torch.testing.assert_close(got[row][kept], want, atol=1e-5, rtol=0)
        p = torch.softmax(z / 0.7, -1)
        torch.testing.assert_close(entropy[row][kept], -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
        assert (got[row][kept] - raw[row][kept]).abs().max() > 1e-3  # not the raw ones


def _update_cfg(temperature: float) -> GRPOConfig:
    return GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": 3, "max_new_tokens": 8, "temperature": temperature},
            "prompts_per_step": 2,
            "mini_batch_size": 6,
            "micro_batch_size": 3,
            "optim": {"learning_rate": 1e-4},
            "dtype": "float32",
        }
    )


def test_the_hf_engine_records_the_trainer_s_tempered_log_prob_so_on_policy_ratios_are_one(tiny):
    """Rollouts the HF engine samples at 0.7 carry ``log softmax(z / 0.7)`` of each sampled
    token: the update at ``rollout.temperature`` 0.7 finds the importance ratio 1 and no
    mismatch. The trainer of before (raw logits, which the update at 1.0 reproduces on the
    same rollouts) measured another policy than the one sampled: the collapse of the naive
    run (docs/benchmarks.md, "Loops come from the eval's lower temperature")."""
    load, tokenizer = tiny
    prompts = _prompts(tokenizer)
    engine = HFRolloutEngine(load(), tokenizer, _update_cfg(0.7).rollout)
    rollouts = engine.generate([p.ids for p in prompts], group_seeds(0, 0, [0, 1], 3))
    assert all(r.response_ids and r.log_probs for r in rollouts)
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.5, 0.0])
    groups = torch.tensor([r.prompt_index for r in rollouts])
    batch = update.Batch(
        prompts, rollouts, rewards, algo.grpo_advantages(rewards, groups),
        torch.ones(6), [],
    )  # fmt: skip
    stats = {}
    for temperature in (0.7, 1.0):
        cfg = _update_cfg(temperature)
        backend = TorchBackend(load(), cfg.optim, 1)
        stats[temperature] = update.policy_update(cfg, backend, batch, 0, 0)
    tempered, raw = stats[0.7], stats[1.0]
    assert tempered["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert tempered["importance_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert tempered["rollout_kl"] < 1e-9 and tempered["rollout_logprob_diff_max"] < 1e-4
    assert raw["rollout_kl"] > 1e-3 and raw["rollout_logprob_diff_max"] > 0.05


def test_the_sync_check_compares_raw_log_probs_whatever_the_rollout_temperature(tiny):
    """An engine on a copy of the policy's weights, sampling at 0.7, scores the probe as the
    policy does (gap ~0): both sides are raw, so the check sees the weights alone. Were one
    side tempered, the gap would be the temperature's, not a stale layer's."""
    load, tokenizer = tiny
    copy = load()
    engine = HFRolloutEngine(copy, tokenizer, RolloutConfig(temperature=0.7))
    backend = TorchBackend(load(), _update_cfg(0.7).optim, 1)
    probe: SyncProbe = sync_probe([p.ids for p in _prompts(tokenizer)], 16)
    assert probe_gap(engine, backend, probe, 0, CPU).max < 1e-5
    ids, response = probe.texts[0].prompt, probe.texts[0].response
    raw = engine.token_log_probs(ids, response)
    with torch.no_grad():
        z = copy(input_ids=torch.tensor([ids + response])).logits[0, :-1][-len(response) :]
    want = torch.log_softmax(z, -1)[torch.arange(len(response)), torch.tensor(response)]
    assert raw == pytest.approx(want.tolist(), abs=1e-5)


def test_vllm_rollout_engines_record_the_processed_log_probs():
    """vLLM's default ``raw_logprobs`` are of the logits before temperature; the rollout
    engines (in-process and dedicated: both build their ``LLM`` from these arguments) ask
    for the sampled distribution's."""
    cfg = RolloutConfig(temperature=0.7)
    assert vllm_engine_kwargs("/m", cfg, None, 1, 0)["logprobs_mode"] == "processed_logprobs"
