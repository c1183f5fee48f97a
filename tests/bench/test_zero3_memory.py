"""bench/zero3_memory.py: GRPO under ZeRO-3 on 2 CPU processes and a 120M-parameter model keeps
no whole copy of the model on any rank (slow: two torchrun runs, ~2 minutes).
tests/trainer/test_zero3.py covers the same path (partitioned load, reference, lockstep
decoding, streamed weights and save) on the smallest model in under a minute."""

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
