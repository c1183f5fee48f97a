"""The step processes of a local run: each in a process group of its own, stopped with the run.

kfp.local (2.17) runs a task as ``sh -ec '… python3 -m kfp.dsl.executor_main …'`` started by
``subprocess_task_handler.run_local_subprocess``; ``sh`` waits for the step's Python, which may
start torchrun and its ranks, data prep's workers or vLLM's engine. A signal to ``lingo run
--local`` alone reached none of them: the step kept running with parent PID 1. Here every
task starts in a new process group (``process_group=0``), asks the kernel to be killed when
``lingo`` dies (``PR_SET_PDEATHSIG`` on ``sh``; the step's Python asks for SIGTERM when ``sh``
dies: ``core.processes.start_step_process``; torchrun's ranks when torchrun dies:
``trainer.entry``), and when ``lingo`` is interrupted (SIGINT: KeyboardInterrupt; SIGTERM:
turned into ``SystemExit(143)`` while the run lasts) or fails, the running step's group gets
the same signal, then SIGKILL after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

from core.processes import LOCAL_RUN_PID_ENV, die_with_parent
from core.redact import redact

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long a signalled step may take to stop (torchrun stops its ranks) before SIGKILL."""


def _in_child(parent: int) -> None:  # runs in the forked child, before exec
    die_with_parent(signal.SIGKILL, parent)  # exits if ``lingo`` died before this took effect


class StepProcesses:
    """The running step processes of a local run."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def start(self, command: list[str], env_vars: dict | None = None, **popen) -> subprocess.Popen:
        """Start a step in a process group of its own, killed when this process dies."""
        env = {**os.environ, **(env_vars or {}), LOCAL_RUN_PID_ENV: str(os.getpid())}
        child = functools.partial(_in_child, os.getpid())
        process = subprocess.Popen(command, env=env, process_group=0, preexec_fn=child, **popen)
        with self._lock:
            self._running.add(process)
        return process

    def finished(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(process)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to every running step's process group; SIGKILL the groups that are
        still there after ``grace_s``; reap the steps."""
        with self._lock:
            running = list(self._running)
            self._running.clear()
        for process in running:
            log.warning("stopping step process %d (its process group) with %s", process.pid, sig)
            _signal_group(process.pid, sig)
        deadline = time.monotonic() + self.grace_s
        for process in running:
            while _group_alive(process) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _group_alive(process):
                _signal_group(process.pid, signal.SIGKILL)
            process.wait()

    def run_printing(self, full_command: list[str], env_vars: dict | None = None) -> int:
        """kfp.local's ``run_local_subprocess`` (its output printed line by line, redacted),
        with the step in its own process group."""
        process = self.start(
            full_command,
            env_vars,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        with self.stopped_on_error(process):
            for line in iter(process.stdout.readline, ""):
                print(redact(line), end="")
            print("\n")
            return process.wait()

    @contextlib.contextmanager
    def stopped_on_error(self, process: subprocess.Popen) -> Iterator[None]:
        """Wait for ``process`` inside this block; leaving it by an exception (SIGINT, SIGTERM,
        an error) stops the step's group first (``Popen``'s own exit would wait for it)."""
        try:
            yield
        except BaseException as exc:
            self.stop(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
            raise
        finally:
            self.finished(process)
            if process.stdout is not None:
                process.stdout.close()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reap the leader (sh): a zombie would count as a member
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def local_steps(grace_s: float = STOP_GRACE_S) -> Iterator[StepProcesses]:
    """While the block runs: kfp.local starts tasks through a ``StepProcesses``, SIGTERM to
    this process raises ``SystemExit(143)``, and leaving the block (normally or not) stops
    every step still running."""
    from kfp.local import subprocess_task_handler

    steps = StepProcesses(grace_s)
    original = subprocess_task_handler.run_local_subprocess
    subprocess_task_handler.run_local_subprocess = steps.run_printing
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        yield steps
    except BaseException as exc:
        steps.stop(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
        raise
    finally:
        subprocess_task_handler.run_local_subprocess = original
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        steps.stop()


def _terminated(signum: int, frame) -> None:
    log.warning("local run: %s received; stopping the running step", signal.Signals(signum).name)
    raise SystemExit(128 + signum)
