"""bench/channel_compat.py: the job's wire (the torchrun agent's TCPStore, the handshake and a
gloo channel of trainer/grpo/remote.py) between two torchrun nodes, every value compared bit
for bit. Here with this env's Python on both sides (fast); the cross-release pair, which the
Megatron branch's two images make (NGC 25.10's torch 2.9 beside torch 2.13 / 2.14), runs
where those envs exist (slow; docs/megatron.md, "Two torch releases in one job", builds them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "bench" / "channel_compat.py"

# loaded by path: bench/ on sys.path would shadow the data_prep package with bench/data_prep.py
_SPEC = importlib.util.spec_from_file_location("channel_compat", TOOL)
channel_compat = importlib.util.module_from_spec(_SPEC)
sys.modules["channel_compat"] = channel_compat
_SPEC.loader.exec_module(channel_compat)

OLD = os.environ.get("LINGO_OLD_TORCH_PYTHON", str(ROOT / ".venv-torch-old" / "bin" / "python"))
"""A Python with torch 2.9.0, the release of NGC 25.10's 2.9.0a0 (the Megatron image's)."""
GPU = os.environ.get("LINGO_GPU_TORCH_PYTHON", str(ROOT / ".venv-torch-gpu" / "bin" / "python"))
"""A Python with torch 2.14.0, the GPU image's (the dedicated vLLM engines')."""
PAIRS = {"2.13 (this env) and 2.9": (sys.executable, OLD), "2.14 and 2.9": (GPU, OLD)}


def _drive(tmp_path: Path, python_a: str, python_b: str, *extra: str, env=None) -> list[dict]:
    out = tmp_path / "results.jsonl"
    command = [sys.executable, str(TOOL), "--python-a", python_a, "--python-b", python_b]
    command += ["--json", str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert out.exists(), done.stderr[-3000:]
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert done.returncode == (0 if all(r["pass"] for r in reports) else 1)
    return reports


def _assert_bit_exact(report: dict, bucket_mb: int) -> None:
    assert report["pass"] and report["error"] is None, report
    assert report["exit_codes"] == [0, 0]
    assert report["checks"] == {
        f"node1.{name}": True for name in ("object", "bucket", "float32", "bfloat16")
    }
    # the bucket, a float32 and a bfloat16 tensor of 1 Mi elements each, and the objects
    tensors = (bucket_mb << 20) + (4 << 20) + (2 << 20)
    assert tensors < report["bytes"] < tensors + (64 << 10)
    assert report["seconds"]["bucket"] > 0 and report["bucket_mb_per_s"] > 0


def test_this_pythons_wire_is_bit_exact_between_two_torchrun_nodes(tmp_path):
    [report] = _drive(tmp_path, sys.executable, sys.executable)
    _assert_bit_exact(report, 64)
    assert report["node0"]["torch"] == report["node1"]["torch"] == torch.__version__
    # the coordinator's handshake logged the one build on both ranks, and no warning
    assert len(report["handshake"]) == 1 and "on ranks [0, 1]" in report["handshake"][0]


def test_a_wire_that_fails_is_reported_with_the_nodes_error(tmp_path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "no-such-interface0"}  # gloo cannot bind
    [report] = _drive(tmp_path, sys.executable, sys.executable, "--timeout-s", "30", env=env)
    assert not report["pass"] and report["exit_codes"] == [1, 1]
    assert "node0: RuntimeError" in report["error"] and "no-such-interface0" in report["error"]
    assert "log_tails" in report


def test_a_value_that_differs_by_one_bit_is_caught():
    same = channel_compat._same_bits
    floats = channel_compat._float_tensors(1 << 12)
    for name, tensor in floats.items():
        flipped = tensor.clone()
        flipped.view(-1)[7:8].view(torch.uint8)[0] ^= 1
        assert same(tensor, tensor.clone()) and not same(tensor, flipped), name
    # NaN payloads and signed zeros are compared as bits, not as values
    assert torch.isnan(floats["float32"]).any() and torch.isinf(floats["bfloat16"]).any()
    assert not same(torch.tensor([0.0]), torch.tensor([-0.0]))
    bucket = channel_compat._bucket(3 << 20)
    assert len(bucket) == 3 << 20 and not torch.equal(bucket[: 1 << 20], bucket[1 << 20 : 2 << 20])


@pytest.mark.slow
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_two_torch_releases_speak_one_wire_in_both_orders(tmp_path, pair):
    pythons = PAIRS[pair]
    missing = [python for python in pythons if not Path(python).exists()]
    if missing:
        pytest.skip(f"torch {pair}: no env at {missing} (docs/megatron.md says how to build it)")
    reports = _drive(tmp_path, *pythons)
    assert len(reports) == 2  # each side hosts the store once
    assert [r["node0"]["bin"] for r in reports] == list(pythons)
    for report in reports:
        _assert_bit_exact(report, 64)
        assert report["node0"]["torch"] != report["node1"]["torch"]
        [warning] = [line for line in report["handshake"] if "two torch releases" in line]
        assert "measured in one job" in warning  # a pair channels.MEASURED_RELEASE_PAIRS holds
