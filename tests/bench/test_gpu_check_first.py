"""The first-GPU checks of bench/gpu_check.py (``--first``, issue #39): each check's own
decision on given figures (what decides PASS or FAIL where only a GPU can produce the figures),
and the runner's rules for them: on a CPU a check whose library needs CUDA, or the Megatron
env, is a SKIP saying so (exit 0); anywhere else it is a FAIL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
sys.path.append(str(ROOT / "bench"))

from gpu_check_first import (  # noqa: E402 (bench/ is not a package)
    adam_speedup_problem,
    driver_verdict,
    engine_mode_problems,
    floor_verdict,
    follow_problems,
    parity_problems,
)
from gpu_checks import CHECKS, FIRST_CHECKS  # noqa: E402


def test_the_first_checks_are_five_each_within_four_minutes():
    assert FIRST_CHECKS == (
        "stack", "vllm-engine-sync", "sync-floor", "zero3-parity", "megatron-convert",
    )  # fmt: skip
    assert all(CHECKS[name].full_limit_s <= 240 for name in FIRST_CHECKS)
    assert CHECKS["megatron-convert"].env == "megatron"


def test_a_driver_older_than_r580_fails_naming_libcudart_13():
    found, problem = driver_verdict(("550.54.15", "nvidia-smi"), 580)
    assert found == "550.54.15 (nvidia-smi)"
    assert "older than R580" in problem and "libcudart.so.13" in problem
    assert driver_verdict(("580.65.06", "/proc/driver/nvidia/version"), 580)[1] is None
    assert "no NVIDIA driver found" in driver_verdict(None, 580)[1]


def test_cpu_adam_must_speed_up_with_threads_only_where_the_node_has_the_cores():
    assert adam_speedup_problem(2.0, 0.25, 16, 16) is None  # 8×
    assert "only 1.10× faster" in adam_speedup_problem(1.1, 1.0, 16, 16)
    assert adam_speedup_problem(1.1, 1.0, 16, 4) is None  # 4 CPUs cannot run 16 threads
    assert "not positive and finite" in adam_speedup_problem(float("nan"), 1.0, 16, 16)


def test_an_engine_without_cuda_graphs_or_compile_fails():
    assert engine_mode_problems(False, "FULL_AND_PIECEWISE", "VLLM_COMPILE") == []
    problems = engine_mode_problems(True, "NONE", "NONE")
    assert len(problems) == 3 and "enforce_eager=True" in problems[0]


def test_the_engine_must_leave_the_policy_while_stale_and_follow_it_once_synced():
    bound = 0.2
    assert follow_problems([{"stale_p95": 1.5, "synced_p95": 0.05}] * 2, bound) == []
    unseen = follow_problems([{"stale_p95": 0.1, "synced_p95": 0.05}], bound)
    assert unseen and "cannot see a sync" in unseen[0]
    stuck = follow_problems(
        [{"stale_p95": 1.5, "synced_p95": 0.05}, {"stale_p95": 1.5, "synced_p95": 1.4}], bound
    )
    assert stuck == [stuck[0]] and stuck[0].startswith("round 2: after the sync")
    assert follow_problems([{"stale_p95": 1.5, "synced_p95": float("nan")}], bound)


def test_the_floor_is_held_to_the_sync_checks_own_ceiling():
    ceiling, problem = floor_verdict(0.1, 0.3, 256, "bfloat16")
    assert ceiling == pytest.approx(0.5) and problem is None  # FLOOR_CEILING 10 × 0.05
    ceiling, problem = floor_verdict(0.1, 0.6, 256, "bfloat16")
    assert "0.6 at the 95th percentile" in problem


def test_zero3_parity_compares_every_step_loss_and_grad_norm():
    ref = [{"step": 1, "loss": 7.0, "grad_norm": 2.0}, {"step": 2, "loss": 6.9, "grad_norm": 1.9}]
    same = [dict(line) for line in ref]
    assert parity_problems(ref, same, 1e-4, 1e-3) == []
    off = [dict(ref[0]), {"step": 2, "loss": 6.9, "grad_norm": 2.5}]
    wrong = parity_problems(ref, off, 1e-4, 1e-3)
    assert wrong == ["step 2 grad_norm: ZeRO-3 2.5, without ZeRO 1.9"]
    assert "steps differ" in parity_problems(ref, ref[:1], 1e-4, 1e-3)[0]
    nan = [dict(ref[0]), {"step": 2, "loss": float("nan"), "grad_norm": 1.9}]
    assert parity_problems(ref, nan, 1e-4, 1e-3)


def _run(tmp_path: Path, *args: str, device: str = "cpu") -> tuple[int, list[str], dict]:
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    command = [sys.executable, str(SCRIPT), "--device", device, "--wheels", str(wheels)]
    command += ["--work-dir", str(tmp_path / "work"), "--report", str(report), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stdout.splitlines(), json.loads(report.read_text())


def test_on_cpu_the_checks_that_need_cuda_or_megatron_skip_saying_so(tmp_path):
    code, lines, report = _run(
        tmp_path, "--dry-run", "--only", "stack", "vllm-engine-sync", "megatron-convert",
        "--megatron-python", sys.executable,
    )  # fmt: skip
    assert code == 0
    checks = {c["name"]: c for c in report["checks"]}
    assert {n: checks[n]["status"] for n in checks} == {
        "install-wheels": "PASS", "stack": "SKIP", "vllm-engine-sync": "SKIP",
        "megatron-convert": "SKIP",
    }  # fmt: skip
    assert checks["vllm-engine-sync"]["detail"].startswith("skipped: needs CUDA (vLLM")
    assert checks["stack"]["detail"].startswith("skipped: needs CUDA (the driver and NCCL")
    assert checks["megatron-convert"]["detail"].startswith("skipped: needs the Megatron env")
    assert any(line.startswith("SKIP vllm-engine-sync") for line in lines)
    assert lines[-1] == "gpu_check: 1 passed, 0 failed, 3 skipped on CPU"
    assert report["passed"] is True and report["skipped"] == [
        "stack", "vllm-engine-sync", "megatron-convert",
    ]  # fmt: skip


def test_with_cuda_asked_for_a_check_that_needs_it_fails(tmp_path):
    code, lines, report = _run(tmp_path, "--only", "sync-floor", device="cuda")
    assert code == 1
    floor = report["checks"][1]
    assert floor["status"] == "FAIL"
    assert floor["detail"].startswith("skipped, which counts as a failure")
    assert report["passed"] is False
