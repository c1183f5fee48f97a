"""bench/zero3_memory.py: GRPO under ZeRO-3 on 2 CPU processes and a 120M-parameter model keeps
no whole copy of the model on any rank (slow: two torchrun runs, ~3 minutes).
tests/trainer/test_zero3.py covers the same path (partitioned load, reference, lockstep
decoding, streamed weights and save) on the smallest model in under a minute."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")


def _bench():
    """bench/zero3_memory.py as a module, loaded from its file: putting bench/ on sys.path
    would let bench/data_prep.py shadow the data_prep package for every later test."""
    path = Path(__file__).resolve().parents[2] / "bench" / "zero3_memory.py"
    spec = importlib.util.spec_from_file_location("bench_zero3_memory", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ASSERTED = 1.5
"""What the test holds the code to, rest / model bytes per rank (measured: 1.38; main's code
before the partitioned load: 5.04). The issue's 0.6 is not met yet: the rest still holds the
policy's own partition (0.5) and ~0.9 of unexplained allocator and DeepSpeed working memory
(docs/benchmarks.md)."""


@pytest.mark.slow
def test_no_rank_holds_a_whole_copy_of_the_model(tmp_path):
    bench = _bench()
    result = bench.measure(tmp_path)
    assert result.parameters >= 100_000_000
    for rank in result.ranks:
        assert rank.overhead > 0 and rank.peak_rss > rank.overhead + rank.training_state
    assert result.worst_ratio <= ASSERTED, bench.report(result)
