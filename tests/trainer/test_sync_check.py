"""The weight-sync check, calibrated by the run's own noise floor, without vLLM (the engine
itself runs in tests/vllm_engines under ``make test-vllm``)."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from generation.vllm import vllm_scheduling_kwargs
from trainer.backends import OptimConfig, make_backend
from trainer.distributed import DistInfo
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine
from trainer.grpo.sync_check import (
    ProbeText,
    SyncBudget,
    SyncCheck,
    SyncGap,
    SyncReport,
    WeightSyncError,
    sync_gap,
    sync_metrics,
    sync_probe,
    sync_tolerance,
    worst,
)
from trainer.grpo.vllm_rollout import vllm_engine_kwargs
from trainer.grpo.weight_sync import sync_engine

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_the_probe_takes_enough_tokens_from_the_first_prompts():
    assert sync_probe([[1, 2, 3, 4, 5]], 2).texts == [ProbeText([1, 2, 3], [4, 5])]
    assert sync_probe([[1, 2]], 32).texts == [ProbeText([1], [2])]  # at most all but one
    probe = sync_probe([[1, 2, 3], [9], [4, 5, 6, 7], [8, 8]], 5)
    assert probe.texts == [ProbeText([1], [2, 3]), ProbeText([4], [5, 6, 7])]
    assert probe.tokens == 5
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sync_probe([[7]], 4)


def test_gap_statistics_are_robust_to_one_token_and_fail_on_a_lost_one():
    policy = [-1.0] * 100
    engine = [-1.0 - 0.01 * (i % 10) for i in range(99)] + [-3.0]  # one token flips
    gap = sync_gap(engine, policy)
    assert gap.max == pytest.approx(2.0) and gap.tokens == 100
    assert gap.p95 == pytest.approx(0.09)  # the 95th smallest of 100
    assert gap.mean == pytest.approx((sum(0.01 * (i % 10) for i in range(99)) + 2.0) / 100)
    assert sync_gap([-1.0], [-1.0, -2.0]).mean == math.inf  # a lost token is a failure
    assert sync_gap([float("nan")], [-1.0]).p95 == math.inf
    both = worst([SyncGap(0.1, 0.5, 1.0, 8), SyncGap(0.2, 0.3, 0.4, 8)])
    assert both == SyncGap(0.2, 0.5, 1.0, 8)
    assert SyncGap.from_json(json.loads(json.dumps(gap.to_json()))) == gap
    assert SyncGap.from_json(None) is None


def test_the_bounds_scale_with_the_learned_floor():
    assert sync_tolerance(None, torch.float32) == 1e-3
    assert sync_tolerance(None, torch.bfloat16) == sync_tolerance(None, torch.float16) == 0.05
    assert sync_tolerance(0.3, torch.float32) == 0.3
    check = SyncCheck(torch.bfloat16, factor=3.0)
    assert check.limits() == (0.05, 0.05)  # no floor yet: the dtype floor alone
    check.learn_floor(SyncGap(0.02, 0.1, 0.9, 256), "E")
    assert check.limits() == pytest.approx((0.11, 0.35))
    kernel_noise = SyncGap(0.05, 0.3, 2.5, 256)  # one token far off: the max is not bounded
    assert check.check(kernel_noise, 5, "E") == kernel_noise
    with pytest.raises(WeightSyncError, match=r"step 5, the E rollout engine.*0\.12 nats"):
        check.check(SyncGap(0.12, 0.3, 0.4, 256), 5, "E")  # the mean moved
    with pytest.raises(WeightSyncError, match="did not take the weights"):
        check.check(SyncGap(0.1, 0.4, 0.5, 256), 5, "E")  # the 95th percentile moved
    with pytest.raises(WeightSyncError, match="loads the model differently"):
        SyncCheck(torch.bfloat16).learn_floor(SyncGap(0.6, 0.9, 3.0, 256), "E")  # > 10 × 0.05
    with pytest.raises(WeightSyncError, match="before the first weight sync"):
        SyncCheck(torch.float32).learn_floor(SyncGap(math.inf, math.inf, math.inf, 3), "E")


def test_the_metrics_line_holds_the_worst_sync_and_the_floor():
    floor = SyncGap(0.01, 0.02, 0.1, 64)
    reports = [
        SyncReport(SyncGap(0.01, 0.03, 0.2, 64), floor, 100, 0.5),
        SyncReport(SyncGap(0.02, 0.02, 0.1, 64), floor, 100, 0.25),
    ]
    assert sync_metrics(reports) == {
        "sync_logprob_mean_diff": 0.02,
        "sync_logprob_p95_diff": 0.03,
        "sync_logprob_max_diff": 0.2,
        "sync_floor_mean_diff": 0.01,
        "sync_floor_p95_diff": 0.02,
        "sync_bytes": 200,
        "sync_s": 0.75,
    }
    assert sync_metrics([]) == {}


def test_the_metrics_line_holds_the_budget_beside_the_time():
    floor = SyncGap(0.01, 0.02, 0.1, 64)
    reports = [SyncReport(SyncGap(0.01, 0.03, 0.2, 64), floor, 100, 0.5, 0.25)] * 2
    metrics = sync_metrics(reports)
    assert (metrics["sync_s"], metrics["sync_budget_s"]) == (1.0, 0.5)


def test_a_sync_over_twice_its_budget_is_warned_about_once(caplog):
    budget = SyncBudget(10.0)
    with caplog.at_level(logging.WARNING, logger="trainer.grpo.sync_check"):
        assert not budget.observe(20.0, 1)  # twice: still within
        assert budget.observe(20.5, 2)
        assert budget.observe(30.0, 3)
    warnings = [r.getMessage() for r in caplog.records if "weight sync" in r.getMessage()]
    assert len(warnings) == 1 and "step 2 took 20.5 s" in warnings[0]
    assert "rollout.sync_budget_s" in warnings[0]
    assert not SyncBudget(None).observe(1e9, 1)


def test_vllm_kwargs_never_split_prompts_on_cpu():
    assert vllm_scheduling_kwargs(None, 1280, cpu=True) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 1280,
    }
    assert vllm_scheduling_kwargs(8192, 1280, cpu=True)["max_num_batched_tokens"] == 8192
    assert vllm_scheduling_kwargs(None, 1280, cpu=False) == {}
    assert vllm_scheduling_kwargs(2048, 1280, cpu=False) == {"max_num_batched_tokens": 2048}
    cfg = RolloutConfig(engine="vllm", max_prompt_tokens=1024, max_new_tokens=256)
    kwargs = vllm_engine_kwargs("/m", cfg, None, 1, 0, dtype="float32", cpu=True)
    assert kwargs["max_model_len"] == 1280 and kwargs["dtype"] == "float32"
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enable_sleep_mode"] is False


def test_a_one_process_vllm_engine_refuses_tensor_parallel():
    from trainer.grpo.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match="torchrun with tensor_parallel_size processes"):
        VLLMRolloutEngine("/m", None, RolloutConfig(engine="vllm", tensor_parallel_size=2))


PROBE = (
    "<|start|>user<|message|>Quelle est la capitale de la France ? Réponds en français, "
    "s'il te plaît, avec une phrase courte et claire.<|end|><|start|>assistant"
)


@pytest.fixture
def policy_and_copy(tiny_model_dir):
    """An fp32 policy in its training backend, an HF engine holding a copy of it (its dtype
    is the ``engine_dtype`` parameter: fp32 unless a test says), the probe, the tokenizer."""

    def build(engine_dtype: torch.dtype = torch.float32):
        policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        backend = make_backend(policy, OptimConfig(learning_rate=1e-2), 4, ONE, 2, 1)
        model = copy.deepcopy(policy).to(engine_dtype).requires_grad_(False)
        engine = HFRolloutEngine(model, tokenizer, RolloutConfig())
        probe = sync_probe([tokenizer(PROBE)["input_ids"]], 64)
        return backend, engine, probe, tokenizer.pad_token_id

    return build


def _train(backend, scale: float = 0.02, seed: int = 0, only: str = "") -> None:
    """An 'update': seeded noise on every parameter (whose name contains ``only``)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in backend.module.named_parameters():
            if only in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)


def _without_experts(backend) -> None:
    """The sync leaves the experts stale: the stream skips them."""
    full = backend.hf_weights
    backend.hf_weights = lambda: ((n, t) for n, t in full() if ".experts." not in n)


def test_sync_check_passes_a_faithful_sync(policy_and_copy):
    backend, engine, probe, pad = policy_and_copy()
    check = SyncCheck(torch.float32)
    first = sync_engine(engine, backend, probe, check, pad, ONE, 0)
    assert check.floor == first.floor and check.floor.mean == 0.0  # fp32 copies: no noise
    _train(backend)
    report = sync_engine(engine, backend, probe, check, pad, ONE, 1)
    assert report.gap.max < 1e-5 and report.gap.tokens == probe.tokens
    assert report.bytes == sum(p.numel() * 4 for p in backend.module.parameters())
    assert report.seconds > 0


def test_sync_check_stops_a_sync_that_leaves_the_experts_stale(policy_and_copy):
    backend, engine, probe, pad = policy_and_copy()
    check = SyncCheck(torch.float32)
    sync_engine(engine, backend, probe, check, pad, ONE, 0)
    _train(backend, 0.05)
    _without_experts(backend)
    with pytest.raises(WeightSyncError, match="step 3"):
        sync_engine(engine, backend, probe, check, pad, ONE, 3)


def test_a_bf16_engine_beside_an_fp32_policy_learns_its_noise_and_still_catches_stale_experts(
    policy_and_copy,
):
    """An injected noise floor: the engine computes in bf16, the policy in fp32 (as vLLM's
    fp32-softmax kernels and HF's bf16 eager attention differ on a GPU). A fixed fp32 bound
    stopped the run at its first sync on kernel noise alone; the calibrated check learns the
    floor, lets faithful syncs through, and still stops the stale experts."""
    backend, engine, probe, pad = policy_and_copy(torch.bfloat16)
    check = SyncCheck(torch.float32)
    first = sync_engine(engine, backend, probe, check, pad, ONE, 0)
    assert first.gap.max > 0.01  # far above an fp32 bound: bf16 noise, not a wrong sync
    assert 0 < check.floor.mean < check.floor.p95 < check.floor.max
    for step in (1, 2):
        _train(backend, seed=step)
        report = sync_engine(engine, backend, probe, check, pad, ONE, step)
        assert report.gap.mean <= check.limits()[0] and report.gap.p95 <= check.limits()[1]
    _train(backend, 0.05, seed=3, only=".experts.")
    _without_experts(backend)
    with pytest.raises(WeightSyncError, match="step 3.*did not take the weights"):
        sync_engine(engine, backend, probe, check, pad, ONE, 3)


def test_a_resumed_run_keeps_the_floor_of_its_first_sync(policy_and_copy):
    """On resume the engine starts from the SFT model and the policy from the checkpoint:
    their difference is no floor. The checkpoint's floor is used; an old checkpoint without
    one takes the difference after the sync (then only the ceiling holds that sync)."""
    backend, engine, probe, pad = policy_and_copy(torch.bfloat16)
    learned = SyncCheck(torch.float32)
    sync_engine(engine, backend, probe, learned, pad, ONE, 0)
    _train(backend, 0.05)  # the checkpoint's policy: the engine still holds the SFT weights
    restored = SyncGap.from_json(json.loads(json.dumps(learned.floor.to_json())))
    resumed = SyncCheck(torch.float32, floor=restored)
    report = sync_engine(engine, backend, probe, resumed, pad, ONE, 4)
    assert resumed.floor == learned.floor and report.floor == learned.floor
    backend2, engine2, _, _ = policy_and_copy(torch.bfloat16)
    _train(backend2, 0.05)
    old = SyncCheck(torch.float32)
    report = sync_engine(engine2, backend2, probe, old, pad, ONE, 4)
    assert old.floor == report.gap  # learned after the sync, not from the stale engine


def test_an_engine_that_loaded_another_model_stops_before_the_first_sync(policy_and_copy):
    backend, engine, probe, pad = policy_and_copy()
    with torch.no_grad():
        for param in engine.model.parameters():
            param.add_(0.05)
    with pytest.raises(WeightSyncError, match="loads the model differently"):
        sync_engine(engine, backend, probe, SyncCheck(torch.float32), pad, ONE, 0)


def test_no_check_when_the_engine_is_the_policy(policy_and_copy, tiny_model_dir):
    backend, _, probe, pad = policy_and_copy()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    shared = HFRolloutEngine(backend.unwrapped(), tokenizer, RolloutConfig())
    assert sync_engine(shared, backend, probe, SyncCheck(torch.float32), pad, ONE, 0) is None
