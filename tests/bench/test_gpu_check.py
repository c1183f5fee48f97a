"""bench/gpu_check.py on CPU: the runner's rules (wheels, watchdog, skipped = FAIL, exit status,
JSON report) and, marked slow, the whole dry run (CI runs it from .ci/run).

Every run here is the script as a subprocess under ``gpu_machine/sitecustomize.py``: only the
GPU image's packages and the carried wheels can be imported, as on the GPU machine, so a check
that starts to need another package fails here first.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
GPU_MACHINE = Path(__file__).resolve().parent / "gpu_machine"
CHECKS = [
    "install-wheels",
    "device",
    "sft",
    "grpo",
    "bf16-numerics",
    "planner",
    "deepspeed",
    "sft-zero3",
    "mxfp4",
    "sync-check",
    "collective-timeout",
    "routing-replay",
    "stack",
    "vllm-engine-sync",
    "sync-floor",
    "zero3-parity",
    "megatron-convert",
]
NEEDS_CUDA = {"stack", "vllm-engine-sync", "sync-floor"}
"""Checks the CPU dry run reports as ``SKIP … skipped: needs CUDA`` (tests/bench/
test_gpu_check_first.py tests their decisions)."""


def _wheel(folder: Path, name: str = "gpu_check_probe", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel (one module), as pip installs it."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{dist}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{dist}/RECORD"]))
    return path


def _run(tmp_path: Path, *args: str, hide: str = "", timeout: float = 300):
    env = {**os.environ, "PYTHONPATH": str(GPU_MACHINE), "GPU_MACHINE_ALSO_HIDE": hide}
    env.pop("OUT", None)
    report = tmp_path / "report.json"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run"]
    command += ["--work-dir", str(tmp_path / "work"), "--report", str(report), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    lines = done.stdout.splitlines()
    return done.returncode, lines, json.loads(report.read_text())


def _statuses(report: dict) -> dict[str, str]:
    return {check["name"]: check["status"] for check in report["checks"]}


def test_carried_wheels_install_and_every_check_gets_a_line(tmp_path):
    _wheel(tmp_path / "wheels")
    code, lines, report = _run(tmp_path, "--wheels", str(tmp_path / "wheels"), "--only", "device")
    assert code == 0
    assert [line.split()[:2] for line in lines[1:3]] == [
        ["PASS", "install-wheels"],
        ["PASS", "device"],
    ]
    assert lines[-1] == "gpu_check: 2 passed, 0 failed"
    assert report["passed"] is True and report["dry_run"] is True
    install = report["checks"][0]
    assert install["figures"]["wheels"] == 1
    assert report["checks"][1]["figures"]["torch"].startswith("2.")


@pytest.mark.parametrize("wheels", ["broken", "missing"])
def test_wheels_that_cannot_be_installed_fail_the_run(tmp_path, wheels):
    folder = tmp_path / "wheels"
    if wheels == "broken":
        folder.mkdir()
        (folder / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    code, lines, report = _run(tmp_path, "--wheels", str(folder), "--only", "device")
    assert code == 1
    assert _statuses(report) == {"install-wheels": "FAIL", "device": "PASS"}
    assert lines[1].startswith("FAIL install-wheels")
    assert lines[-1] == "gpu_check: 1 passed, 1 failed"


def test_a_skipped_check_is_a_failure(tmp_path):
    code, lines, report = _run(
        tmp_path, "--wheels", str(_wheel(tmp_path / "w").parent), "--only", "deepspeed",
        hide="deepspeed",
    )  # fmt: skip
    assert code == 1
    deepspeed = report["checks"][1]
    assert deepspeed["status"] == "FAIL"
    assert deepspeed["detail"].startswith("skipped, which counts as a failure: DeepSpeed cannot")
    assert any(line.startswith("FAIL deepspeed") for line in lines)
    assert report["passed"] is False


def test_checks_past_the_time_budget_fail(tmp_path):
    wheels = str(_wheel(tmp_path / "w").parent)
    code, _, report = _run(tmp_path, "--wheels", wheels, "--budget-s", "3", "--only", "sft", "grpo")
    assert code == 1
    assert _statuses(report) == {"install-wheels": "PASS", "sft": "FAIL", "grpo": "FAIL"}
    assert {c["detail"] for c in report["checks"][1:]} == {"not reached: the time budget is spent"}


def test_without_cuda_the_cuda_run_fails(tmp_path):
    wheels = str(_wheel(tmp_path / "w").parent)
    env = {**os.environ, "PYTHONPATH": str(GPU_MACHINE), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(SCRIPT), "--device", "cuda", "--only", "device"]
    command += ["--wheels", wheels, "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert "FAIL device" in done.stdout and "torch.cuda.is_available() is False" in done.stdout


@pytest.mark.slow
def test_dry_run_passes_every_check_end_to_end(tmp_path):
    """The whole script on CPU with tiny shapes (~3 min on 2 busy cores); ``megatron-convert``
    runs in ``.venv-megatron`` where CI built it (make test-megatron; or
    ``$LINGO_MEGATRON_PYTHON``), else it skips."""
    (tmp_path / "wheels").mkdir()
    code, lines, report = _run(tmp_path, "--wheels", str(tmp_path / "wheels"), timeout=600)
    failed = [c for c in report["checks"] if c["status"] not in ("PASS", "SKIP")]
    assert code == 0, json.dumps(failed, indent=2)
    assert [c["name"] for c in report["checks"]] == CHECKS
    built = ROOT / ".venv-megatron" / "bin" / "python"
    megatron = bool(os.environ.get("LINGO_MEGATRON_PYTHON")) or built.is_file()
    skipped = NEEDS_CUDA | (set() if megatron else {"megatron-convert"})
    assert [line.split()[:2] for line in lines[1:-1] if not line.startswith(" ")] == [
        ["SKIP" if name in skipped else "PASS", name] for name in CHECKS
    ]
    figures = {c["name"]: c["figures"] for c in report["checks"]}
    assert all(math.isfinite(figures[name]["loss"]) for name in ("grpo", "deepspeed"))
    assert figures["sft"]["last_loss"] < figures["sft"]["first_loss"] + 1.0
    assert figures["deepspeed"]["ops_prebuilt"] == 0
    planner = figures["planner"]
    assert 0 < planner["ratio"] <= 1.5 and planner["rollout_tokens_per_s"] > 0
    assert figures["bf16-numerics"]["top1"] >= 0.9
    held, total = map(int, figures["sft-zero3"]["loaded"].split(" of "))
    assert held == total  # one process: its partition is the whole model
    assert figures["mxfp4"]["matrices"] == 4 and figures["mxfp4"]["experts"] == "GptOssExperts"
    parity = figures["zero3-parity"]
    assert parity["loss_zero3"] == pytest.approx(parity["loss_no_zero"], rel=1e-4)
    assert parity["persistence_threshold"] == 100_000  # DeepSpeed's default
    if megatron:
        assert figures["megatron-convert"]["top1"] == 1.0
