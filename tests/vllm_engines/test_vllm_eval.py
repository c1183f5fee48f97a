"""The eval's vLLM engine on vLLM's CPU build: the 50-question eval end to end, one seed per
response. Skipped where vLLM is missing; ``make test-vllm`` runs it."""

from __future__ import annotations

from collections import Counter

from eval.eval_config import EvalConfig, SamplingSettings
from eval.report import load_results
from eval.runner import run_eval


def test_the_fifty_question_eval_runs_on_vllm(tmp_path, vllm_model_dir):
    config = EvalConfig(
        engine="vllm",
        dtype="float32",
        sampling=SamplingSettings(max_tokens=16, n=2, seed=3),
        # 100 seeded requests of ~120 prompt tokens, more than one step's budget: on the CPU
        # build a split prompt would crash the engine (generation.vllm.vllm_scheduling_kwargs)
        vllm_max_num_batched_tokens=2048,
    )
    run_eval([f"tiny={vllm_model_dir}"], config, tmp_path)
    responses = load_results(tmp_path)["responses"]
    assert len(responses) == 100 and not [r for r in responses if r["error"]]
    by_question = Counter(r["id"] for r in responses)
    assert set(by_question.values()) == {2} and len(by_question) == 50
    # each response its own seed: the two samples of a question differ (nearly always)
    texts: dict[str, list[str]] = {}
    for r in responses:
        texts.setdefault(r["id"], []).append(r["text"])
    assert sum(a != b for a, b in texts.values()) >= 45
