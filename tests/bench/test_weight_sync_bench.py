"""bench/weight_sync.py (issue #42): its CPU dry run end to end, and its GPU run where CUDA is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "weight_sync.py"


def _rows(*args: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], check=True, timeout=600)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_the_dry_run_sends_the_tiny_demo_model_to_two_workers_without_relay(tmp_path):
    (row,) = _rows("--dry-run", tmp_path=tmp_path)
    assert (row["model"], row["transport"], row["workers"]) == ("tiny-demo", "lingo_gloo", 2)
    assert row["bytes_per_worker"] == 1_940_880 * 4  # every fp32 weight of the demo model
    assert row["bytes"] == 2 * row["bytes_per_worker"]
    assert row["relay_factor"] == 1.0 and row["collectives_per_bucket"] == 1.0
    assert row["buckets"] > 1 and row["seconds"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_run_measures_the_two_layer_gpt_oss_20b_stream(tmp_path):
    rows = _rows("--device", "cuda", tmp_path=tmp_path)
    by_transport = {row["transport"]: row for row in rows}
    gloo = by_transport["lingo_gloo"]
    assert gloo["relay_factor"] == 1.0 and gloo["gb_per_s_per_worker"] > 0
    nccl = by_transport["nccl"]
    if torch.cuda.device_count() > 1:
        assert nccl["relay_factor"] == 1.0
        assert nccl["gb_per_s_per_worker"] > gloo["gb_per_s_per_worker"]
    else:
        assert nccl["measured"] is False
