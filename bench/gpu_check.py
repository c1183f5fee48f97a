"""The GPU check: one command on a bare GPU machine, one PASS/FAIL line per check.

    python3 bench/gpu_check.py                        # on the GPU machine: docs/benchmarks.md
    python3 bench/gpu_check.py --first                # the five first-GPU checks (issue #39)
    python bench/gpu_check.py --device cpu --dry-run  # the same script end to end, tiny shapes

First it installs the carried wheels (``tools/build_gpu_wheels.py`` builds ``.whl/gpu``) into
a temporary site directory that every check sees first; then it runs each check of
``bench/gpu_checks.py`` in a process of its own (so a hung kernel can be killed and each
check's GPU memory peak is its own) under a watchdog: each check has a time limit, and the
whole run a budget (default 450 s, under the 8 minutes a GPU call may spend on it); a check
the budget cannot reach is a FAIL. A check that cannot run (a missing package, no CUDA) is a
FAIL too: nothing is skipped silently. The one exception is the CPU dry run, where a check
whose library cannot run on a CPU (NCCL, vLLM's CUDA graphs) or whose env is not here (the
Megatron env) prints ``SKIP name  skipped: needs CUDA (…)``. Exit status 0 only when every
check passed or was skipped that way.

A check of the Megatron env (``megatron-convert``) runs in ``--megatron-python`` (default
``$LINGO_MEGATRON_PYTHON``, else ``.venv-megatron/bin/python`` when it exists, else this
Python: in the Megatron image that is the image's own), with only the repository on its path.

Output: one line per check, ``PASS name  seconds  figures`` or ``FAIL name  seconds  why``,
then a summary line; a JSON report (every figure, each failing check's log tail) to
``--report``, or to ``$OUT/gpu_check.json`` when ``OUT`` is set, with the checks' logs beside
it as ``gpu_check.log``.

Only the standard library is imported here: the checks' own imports (pydantic among them)
may come from the wheels this script installs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# Python put bench/ first on the path, where bench/data_prep.py would shadow the package:
# the repository goes first, bench/ (for the check modules) last.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.append(str(HERE))

from gpu_checks import CHECKS, FIRST_CHECKS, Sizes, run_check  # noqa: E402 (after the path set-up)

DEFAULT_WHEELS = ROOT / ".whl" / "gpu"
DEFAULT_BUDGET_S = 450.0
LOG_TAIL_LINES = 15


def _result(name: str, status: str, seconds: float, figures=None, detail: str = "") -> dict:
    return {
        "name": name,
        "status": status,
        "seconds": round(seconds, 1),
        "figures": figures or {},
        "detail": detail,
    }


def _line(result: dict) -> str:
    figures = "  ".join(f"{k}={_format(v)}" for k, v in result["figures"].items())
    parts = [f"{result['status']} {result['name']}", f"{result['seconds']:.1f}s"]
    parts += [p for p in (result["detail"], figures) if p]
    return "  ".join(parts)


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def install_wheels(wheels: Path, site: Path) -> dict:
    """``pip install --no-index --no-deps --target site`` every wheel in ``wheels``.

    An empty folder installs nothing and passes; a missing one fails (the wheels were not
    built or not carried).
    """
    started = time.monotonic()
    name = "install-wheels"
    if not wheels.is_dir():
        detail = f"{wheels} missing: build it with tools/build_gpu_wheels.py and carry it"
        return _result(name, "FAIL", 0.0, detail=detail)
    files = sorted(wheels.glob("*.whl"))
    size = sum(f.stat().st_size for f in files)
    figures = {"wheels": len(files), "mib": round(size / 2**20, 1), "target": str(site)}
    if files:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        command += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site)]
        done = subprocess.run(command + [str(f) for f in files], capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            detail = f"pip exit {done.returncode}: {' | '.join(tail)}"
            return _result(name, "FAIL", time.monotonic() - started, figures, detail)
    return _result(name, "PASS", time.monotonic() - started, figures)


def _check_environment(site: Path) -> dict[str, str]:
    """The checks' environment: the wheels' site first, the repository importable, no MLflow."""
    env = dict(os.environ)
    paths = [str(site), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MLFLOW_TRACKING_URI", None)  # the checks train; they report to no server
    return env


def megatron_python(given: Path | None) -> str:
    """The Megatron env's Python: ``given``, ``$LINGO_MEGATRON_PYTHON``, the repository's
    ``.venv-megatron`` when built, else this one (the Megatron image)."""
    if given is not None:
        return str(given)
    if os.environ.get("LINGO_MEGATRON_PYTHON"):
        return os.environ["LINGO_MEGATRON_PYTHON"]
    built = ROOT / ".venv-megatron" / "bin" / "python"
    return str(built) if built.is_file() else sys.executable


def _megatron_environment() -> dict[str, str]:
    """The Megatron env's checks see its own packages and the repository, nothing carried."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def run_one(
    name: str, args: argparse.Namespace, work: Path, env: dict[str, str], limit: float
) -> dict:
    """Run check ``name`` in its own process, killed after ``limit`` seconds."""
    result_file = work / f"{name}.result.json"
    log_file = work / f"{name}.log"
    python = sys.executable
    if CHECKS[name].env == "megatron":
        python, env = megatron_python(args.megatron_python), _megatron_environment()
    command = [python, str(Path(__file__).resolve()), "--run-check", name]
    command += ["--device", args.device, "--work-dir", str(work), "--result", str(result_file)]
    if args.dry_run:
        command.append("--dry-run")
    started = time.monotonic()
    with log_file.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the check and anything it started (torchrun workers)
            process.wait()
            code = None
    seconds = time.monotonic() - started
    if code is None:
        return _result(name, "FAIL", seconds, detail=f"timed out after {limit:.0f}s (watchdog)")
    if not result_file.is_file():
        return _result(name, "FAIL", seconds, detail=f"exit {code} without a result: {log_file}")
    outcome = json.loads(result_file.read_text())
    return _result(name, outcome["status"], seconds, outcome["figures"], outcome["detail"])


def _log_tail(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, few steps")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS)
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"the whole run's budget (default {DEFAULT_BUDGET_S:.0f} s; with --first the sum "
        "of its checks' limits)",
    )
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run these checks")
    parser.add_argument(
        "--first", action="store_true", help=f"the first-GPU checks: {', '.join(FIRST_CHECKS)}"
    )
    parser.add_argument("--megatron-python", type=Path, help="the Megatron env's Python")
    parser.add_argument("--report", type=Path, help="JSON report (default $OUT/gpu_check.json)")
    parser.add_argument("--work-dir", type=Path, help="models, data and logs (default: a temp dir)")
    parser.add_argument("--run-check", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_check:  # inside one check's process
        return run_check(args.run_check, Sizes.for_run(args.dry_run, args.device), args)

    if args.budget_s is None:
        first = sum(CHECKS[n].limit_s(args.dry_run) for n in FIRST_CHECKS)
        args.budget_s = first if args.first and not args.only else DEFAULT_BUDGET_S
    deadline = time.monotonic() + args.budget_s
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))
    mode = "dry run, tiny shapes" if args.dry_run else "full sizes"
    print(f"gpu_check: device {args.device}, {mode}, budget {args.budget_s:.0f}s, work {work}")
    results = [install_wheels(args.wheels, site)]
    print(_line(results[0]), flush=True)
    env = _check_environment(site)
    names = args.only or (list(FIRST_CHECKS) if args.first else list(CHECKS))
    for name in names:
        left = deadline - time.monotonic()
        limit = min(CHECKS[name].limit_s(args.dry_run), left)
        if limit < 5:
            result = _result(name, "FAIL", 0.0, detail="not reached: the time budget is spent")
        else:
            result = run_one(name, args, work, env, limit)
        results.append(result)
        print(_line(result), flush=True)
        for text in _log_tail(work / f"{name}.log") if result["status"] == "FAIL" else []:
            print(f"    | {text}")
    failed = [r["name"] for r in results if r["status"] not in ("PASS", "SKIP")]
    skipped = [r["name"] for r in results if r["status"] == "SKIP"]
    passed = len(results) - len(failed) - len(skipped)
    summary = f"gpu_check: {passed} passed, {len(failed)} failed"
    print(summary + (f", {len(skipped)} skipped on CPU" if skipped else ""), flush=True)
    _write_report(args, work, results)
    shutil.rmtree(site, ignore_errors=True)
    return 1 if failed else 0


def _write_report(args: argparse.Namespace, work: Path, results: list[dict]) -> None:
    out = os.environ.get("OUT")
    report = args.report or (Path(out) / "gpu_check.json" if out else None)
    if report is None:
        return
    for result in results:
        result["log_tail"] = _log_tail(work / f"{result['name']}.log")
    payload = {
        "device": args.device,
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "passed": all(r["status"] in ("PASS", "SKIP") for r in results),
        "skipped": [r["name"] for r in results if r["status"] == "SKIP"],
        "checks": results,
    }
    report.parent.mkdir(parents=True, exist_ok=True)
    tmp = report.with_name(f".{report.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, report)
    logs = [work / f"{r['name']}.log" for r in results]
    text = "".join(f"==> {p.name}\n{p.read_text(errors='replace')}" for p in logs if p.is_file())
    (report.parent / "gpu_check.log").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
