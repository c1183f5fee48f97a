"""bench/zero3_memory.py: GRPO and SFT under ZeRO-3 on 2 CPU processes and a 120M-parameter
model keep no whole copy of the model on any rank beyond what the step needs by design (SFT's
merge on rank 0) (slow: two torchrun runs each, ~2 minutes idle). tests/trainer/test_zero3.py
covers GRPO's path (partitioned load, reference, lockstep decoding, streamed weights and save)
on the smallest model in under a minute; tests/trainer/test_training_load.py and the SFT
ZeRO-3 process test cover SFT's partitioned load."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

# loaded by path: bench/ on sys.path would shadow the data_prep package with bench/data_prep.py
# for every test collected after this one
_SPEC = importlib.util.spec_from_file_location(
    "zero3_memory", Path(__file__).resolve().parents[2] / "bench" / "zero3_memory.py"
)
zero3_memory = importlib.util.module_from_spec(_SPEC)
sys.modules["zero3_memory"] = zero3_memory
_SPEC.loader.exec_module(zero3_memory)

ASSERTED = zero3_memory.TARGET
"""The issue's target, rest / model bytes per rank ≤ 0.6 (measured: 0.39 on both ranks; main's
code before the partitioned load: see docs/benchmarks.md). The rest is what a rank holds
beyond the fixed overhead and its partition of the weights, gradients and AdamW moments."""


@pytest.mark.slow
def test_no_rank_holds_a_whole_copy_of_the_model(tmp_path):
    result = zero3_memory.measure(tmp_path)
    assert result.parameters >= 100_000_000
    for rank in result.ranks:
        assert rank.overhead > 0 and rank.peak_rss > rank.overhead + rank.training_state
    assert result.worst_ratio <= ASSERTED, zero3_memory.report(result)


@pytest.mark.slow
def test_no_sft_rank_holds_a_copy_of_the_model_it_does_not_need(tmp_path):
    """Before SFT loaded partitioned, every rank held the whole model at load, and rank 0 three
    copies at the merge (docs/benchmarks.md): rest / model 2.09 on rank 1, 1.28 on rank 0."""
    result = zero3_memory.measure(tmp_path, step="sft")
    assert result.parameters >= 100_000_000
    assert result.ranks[0].final_model == 2 * result.model_bytes  # the merge and its reload
    for rank in result.ranks:
        assert rank.overhead > 0 and rank.training_state > 0
    assert result.worst_ratio <= zero3_memory.TARGETS["sft"], zero3_memory.report(result)
