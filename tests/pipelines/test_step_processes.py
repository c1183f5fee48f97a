"""Every step process dies with its parent (issue #32 item 11).

On main, SIGTERM to ``lingo run --local`` during GRPO or eval, or SIGINT during base-model, left
the step's process (``kfp.dsl.executor_main``) running with parent PID 1 for 15-60 s, still
writing. These tests run the real CLI, signal the ``lingo`` process alone while a chosen step
runs, and check that every process of that step is gone. Linux only (``/proc``, process groups,
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST_LOCAL_RUN as FAST

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

LINGO = str(Path(sys.executable).with_name("lingo"))


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """Running (a zombie, which only waits to be reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(root: int) -> dict[int, str]:
    """pid → command line of every living process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (parent := _parent(int(entry.name))) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmdline = (Path(f"/proc/{child}/cmdline").read_bytes()).replace(b"\0", b" ")
            except OSError:
                continue
            if _alive(child):
                found[child] = cmdline.decode(errors="replace")
                todo.append(child)
    return found


def _wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _start_run(tmp_path: Path) -> subprocess.Popen:
    """``lingo run --local`` as a user starts it from a terminal: SIGINT (Ctrl-C) at its
    default action. A job a non-interactive shell starts in the background (``cmd &``, as CI
    scripts and ``nohup`` do) inherits SIGINT *ignored*, and Python keeps an ignored SIGINT
    ignored: lingo would then run to the end and exit 0 whatever the test sends."""
    sets = [arg for key, value in FAST.items() for arg in ("--set", f"{key}={value}")]
    return subprocess.Popen(
        [LINGO, "run", "--local", "-o", str(tmp_path / "runs"), *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_at_its_default,
    )


def _sigint_at_its_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_step(run: subprocess.Popen, step: str, timeout_s: float = 420) -> dict[int, str]:
    """Read the run's step lines until ``step`` starts; then the processes of that step (its
    ``executor_main`` writes under ``…/<step>/``), once they are there."""
    deadline = time.monotonic() + timeout_s
    for line in run.stdout:
        if f"{step} " in line and line.rstrip().endswith("started"):
            break
        if "FAILURE" in line or time.monotonic() > deadline:
            pytest.fail(f"the run did not reach {step}: {line}")
    else:
        pytest.fail(f"the run ended before {step}: {run.stderr.read()[-2000:]}")
    while time.monotonic() < deadline:
        processes = _descendants(run.pid)
        if any("executor_main" in c and f"/{step}/" in c for c in processes.values()):
            return processes
        time.sleep(0.05)
    pytest.fail(f"no step process of {step} under lingo ({run.pid})")


@pytest.mark.parametrize(
    ("step", "sig"),
    [
        # the default cases stop the earliest steps (every step is the same kind of process,
        # kfp.local's `sh` running executor_main): CI time; the later steps are the slow
        # cases, base-model's SIGINT and SIGKILL covered by start-tracking's by default
        ("data-prep", signal.SIGTERM),
        ("start-tracking", signal.SIGINT),
        pytest.param("sft", signal.SIGTERM, marks=pytest.mark.slow),
        # the GRPO cases wait for SFT first (295 s at load ~10); a step's child processes (as
        # torchrun's ranks) are covered by test_a_step_and_its_child_die_when_sh_dies and
        # test_stop_ends_the_whole_process_group below, in seconds
        pytest.param("grpo", signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param("grpo", signal.SIGINT, marks=pytest.mark.slow),
        pytest.param("evaluate", signal.SIGTERM, marks=pytest.mark.slow),
        # SIGKILL cannot be caught: the kernel's parent-death signal stops the step (sh gets
        # SIGKILL when lingo dies, the step's Python SIGTERM when sh dies)
        ("start-tracking", signal.SIGKILL),
        pytest.param("base-model", signal.SIGINT, marks=pytest.mark.slow),
        pytest.param("base-model", signal.SIGKILL, marks=pytest.mark.slow),
    ],
)
def test_a_signal_to_the_local_run_stops_the_running_step(step, sig, tmp_path):
    run = _start_run(tmp_path)
    try:
        processes = _wait_for_step(run, step)
        run.send_signal(sig)  # to lingo alone, as `kill PID` does
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    left = _wait_gone(processes, timeout_s=15)
    assert not left, {p: processes[p][:120] for p in left}
    assert run.returncode != 0
    if sig == signal.SIGTERM:
        assert run.returncode == 128 + signal.SIGTERM


CHILD_TREE = """
import subprocess, sys
from core.processes import start_step_process
start_step_process()
subprocess.run([sys.executable, "-c", "import time; time.sleep(120)"])  # as torchrun is run
"""


def _start_tree(steps) -> tuple[subprocess.Popen, dict[int, str]]:
    """``sh -ec 'python -c …'``, as kfp.local starts a step, the step running a child."""
    process = steps.start(["sh", "-ec", f"{sys.executable} -c '{CHILD_TREE}'\n"])
    deadline = time.monotonic() + 60
    while len(tree := _descendants(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tree) == 2, tree  # the step's Python and its child
    return process, tree


def test_stop_ends_the_whole_process_group():
    from pipelines.step_processes import StepProcesses

    steps = StepProcesses(grace_s=5)
    process, tree = _start_tree(steps)
    began = time.monotonic()
    steps.stop(signal.SIGTERM)
    assert process.returncode is not None and time.monotonic() - began < 5
    assert not _wait_gone([process.pid, *tree], timeout_s=5)


def test_a_step_and_its_child_die_when_sh_dies():
    """The step's Python (``start_step_process``) gets SIGTERM when its parent dies, and
    unwinds: ``subprocess.run`` kills the child it waits for."""
    from pipelines.step_processes import StepProcesses

    steps = StepProcesses()
    process, tree = _start_tree(steps)
    os.kill(process.pid, signal.SIGKILL)  # sh alone, not its group
    process.wait()
    steps.finished(process)
    left = _wait_gone(tree, timeout_s=10)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, tree


def test_a_step_whose_sh_died_before_it_armed_its_parent_death_signal_exits(tmp_path):
    """Issue #44 item 8: SIGKILL of ``lingo`` as "base-model started" printed killed ``sh``
    (its parent-death signal) while the step's Python was still importing, before it asked
    for its own: it ran on under PID 1 for 7-10 s. The step now compares its parent with the
    one the local run started it under, and exits when that one is gone."""
    from pipelines.step_processes import StepProcesses

    marker = tmp_path / "ran-on"
    script = (
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "sh = os.getppid()\n"
        "os.kill(sh, signal.SIGKILL)  # as the parent-death signal does when lingo dies\n"
        "while os.getppid() == sh:\n"
        "    time.sleep(0.01)\n"
        "from core.processes import start_step_process\n"
        "start_step_process()\n"
        f"open({str(marker)!r}, 'w').write('ran on')\n"
    )
    steps = StepProcesses()
    process = steps.start(["sh", "-c", f'{sys.executable} -c "$0"; true', script])
    process.wait()
    steps.finished(process)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the orphaned Python, if any, in sh's group
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    assert not marker.exists()


def test_a_base_model_interrupted_half_way_leaves_no_model_folder(tmp_path, monkeypatch):
    """Issue #44 item 8: a killed base-model step left ``base-model/model/`` holding only the
    config files, a folder a later step would take as the model."""
    import shutil

    import trainer.base_model as base_model
    from trainer.tiny_model import SMALLEST, build_tiny_model

    source = build_tiny_model(tmp_path / "source", SMALLEST)

    def killed_half_way(src, dst, **kwargs):
        Path(dst).mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(src) / "config.json", dst)
        raise SystemExit(143)  # SIGTERM in a step process (core.processes)

    monkeypatch.setattr(base_model.shutil, "copytree", killed_half_way)
    out = tmp_path / "base-model" / "model"
    with pytest.raises(SystemExit):
        base_model.materialize_base_model(str(source), out, SMALLEST)
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no staging folder left
    monkeypatch.undo()
    base_model.materialize_base_model(str(source), out, SMALLEST)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
