"""Independent samples in GRPO rollouts: one seed per (step, prompt slot, sample), on the HF
engine (one generator per row) and in what the vLLM engine is given (one request each)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.seeds import group_seeds
from generation.vllm import vllm_sampling_kwargs
from plan import ParallelSizes
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine, Rollout, generate_group_slots
from trainer.grpo.vllm_rollout import vllm_engine_kwargs
from trainer.placement import RolloutEngines, plan_placement


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return HFRolloutEngine(model, tokenizer, RolloutConfig(max_new_tokens=4))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 900, (12,), generator=gen).tolist() for _ in range(8)]


def _groups(out: list[Rollout], count: int) -> list[list[list[int]]]:
    return [[r.response_ids for r in out if r.prompt_index == i] for i in range(count)]


def test_same_prompt_twice_in_a_batch_gives_two_groups(engine, prompts):
    out = engine.generate([prompts[0], prompts[0]], group_seeds(7, 0, [0, 1], 8))
    first, second = _groups(out, 2)
    assert first != second
    assert sum(a == b for a, b in zip(first, second, strict=True)) <= 1


def test_same_seeds_reproduce_and_the_batch_does_not_matter(engine, prompts):
    seeds = group_seeds(7, 3, range(8), 8)
    out = engine.generate(prompts, seeds)
    assert out == engine.generate(prompts, seeds)
    # prompt 3 alone, and in a batch of other prompts, with its own seeds: the same samples
    alone = engine.generate([prompts[3]], [seeds[3]])
    assert [r.response_ids for r in alone] == _groups(out, 8)[3]
    engine.batch_size = 16  # two prompts a chunk: other chunk boundaries
    try:
        rechunked = engine.generate([prompts[5], prompts[3]], [seeds[5], seeds[3]])
    finally:
        engine.batch_size = 64
    assert _groups(rechunked, 2)[1] == _groups(out, 8)[3]
    # another step draws other samples
    assert engine.generate(prompts, group_seeds(7, 4, range(8), 8)) != out


def test_first_tokens_vary_across_prompts_for_every_sample_index(engine, prompts):
    groups = _groups(engine.generate(prompts, group_seeds(1, 0, range(8), 8)), 8)
    distinct = [len({groups[p][k][0] for p in range(8)}) for k in range(8)]
    assert min(distinct) >= 6, distinct


def test_vllm_gets_one_request_per_response_with_its_own_seed():
    cfg = RolloutConfig(engine="vllm", max_new_tokens=256, temperature=0.9, top_p=0.95)
    seeds = group_seeds(42, 5, range(8), 4)
    # per response, what VLLMGenerator.complete gives vLLM (the rollout asks for log-probs)
    params = [
        [vllm_sampling_kwargs(cfg.sampling, seed, [4, 6], logprobs=True) for seed in group]
        for group in seeds
    ]
    assert [len(group) for group in params] == [4] * 8
    flat = [p for group in params for p in group]
    assert {p["n"] for p in flat} == {1}
    assert len({p["seed"] for p in flat}) == 32
    assert [p["seed"] for p in params[2]] == seeds[2]
    assert {(p["temperature"], p["top_p"], p["max_tokens"]) for p in flat} == {(0.9, 0.95, 256)}
    assert {tuple(p["stop_token_ids"]) for p in flat} == {(4, 6)}
    # a seed + k scheme would overlap across prompts; these never do
    assert not {s + 1 for s in seeds[0]} & set(seeds[1])


def test_vllm_engine_kwargs_follow_the_plan():
    cfg = RolloutConfig(engine="vllm", tensor_parallel_size=4, colocate=True)
    plan = plan_placement(2, 8, ParallelSizes(dp=16), RolloutEngines(tp=4))
    engine = plan.engine_of(13)
    kwargs = vllm_engine_kwargs("/m", cfg, engine, 16, seed=42)
    assert kwargs["tensor_parallel_size"] == 4
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["seed"] == 42 + 3 == vllm_engine_kwargs("/m", cfg, engine, 16, 42)["seed"]
    assert engine.ranks == (12, 13, 14, 15) and engine.cuda_visible_devices == "4,5,6,7"
    alone = vllm_engine_kwargs("/m", cfg, None, 1, seed=42)
    assert "distributed_executor_backend" not in alone and alone["tensor_parallel_size"] == 4


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list, list]] = []

    def generate(self, prompts, seeds):
        self.calls.append((prompts, seeds))
        return [Rollout(i, [p[0], s], True) for i, p in enumerate(prompts) for s in seeds[i]]


def test_every_worker_of_an_engine_submits_the_same_requests_and_keeps_its_share():
    prompts = [[100 + s] for s in range(8)]  # 4 ranks × 2 prompts
    seeds = group_seeds(0, 0, range(8), 2)
    recorders = [_Recorder() for _ in range(4)]
    shares = [generate_group_slots(recorders[r], prompts, seeds, (2, 3), r, 2) for r in (2, 3)]
    assert recorders[2].calls == recorders[3].calls  # identical requests on both workers
    assert recorders[2].calls[0][0] == prompts[4:8]
    assert [(r.prompt_index, r.response_ids[0]) for r in shares[0]] == [
        (0, 104), (0, 104), (1, 105), (1, 105)
    ]  # fmt: skip
    assert [r.response_ids[0] for r in shares[1]] == [106, 106, 107, 107]
    assert [r.response_ids[1] for r in shares[1]] == [s for g in seeds[6:8] for s in g]


def test_finished_rows_leave_the_batch_and_change_no_sample(tiny_model_dir, prompts, monkeypatch):
    """Rows that hit a stop token are dropped from the decode batch (their KV cache with them):
    every row's tokens and behaviour log-probs are those of the loop that keeps them all, and
    the forwards run fewer rows."""
    from trainer.grpo import rollout

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(max_new_tokens=24))
    # one token in 16 stops a row: rows end at many different steps
    engine.stop_ids = set(range(0, model.config.vocab_size, 16))
    seeds = group_seeds(11, 0, range(4), 8)
    batch_rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: batch_rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        compacted = engine.generate(prompts[:4], seeds)
        compacted_rows, batch_rows[:] = sum(batch_rows[1:]), []  # decode steps, not prefill
        monkeypatch.setattr(rollout, "_rows_to_keep", lambda finished: None)
        full = engine.generate(prompts[:4], seeds)
        full_rows = sum(batch_rows[1:])
    finally:
        hook.remove()
    lengths = sorted(len(r.response_ids) for r in full)
    assert lengths[0] < 6 and lengths[-1] > 12, lengths  # the rows did end apart
    assert [r.response_ids for r in compacted] == [r.response_ids for r in full]
    assert [r.finished for r in compacted] == [r.finished for r in full]
    for a, b in zip(compacted, full, strict=True):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs))
    assert compacted_rows < 0.75 * full_rows, (compacted_rows, full_rows)


def test_rows_to_keep_compacts_once_an_eighth_has_finished():
    from trainer.grpo.rollout import _rows_to_keep

    finished = torch.zeros(16, dtype=torch.bool)
    assert _rows_to_keep(finished) is None
    finished[3] = True  # 1 of 16: not yet worth a copy of the cache
    assert _rows_to_keep(finished) is None
    finished[7] = True
    assert _rows_to_keep(finished).tolist() == [i for i in range(16) if i not in (3, 7)]
    # a lockstep rank whose rows have all finished keeps one row for its collective forwards
    assert _rows_to_keep(torch.ones(4, dtype=torch.bool)).tolist() == [0]
    assert _rows_to_keep(torch.ones(1, dtype=torch.bool)) is None
