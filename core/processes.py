"""Processes that die with the process that started them.

``die_with_parent`` asks the Linux kernel to signal this process when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), however the parent dies (SIGKILL included). The pipeline's step
processes (``start_step_process``), torchrun's ranks and data prep's workers call it first, so
a killed ``lingo run --local`` or a killed step leaves nothing running (the local run also
stops its steps' process groups itself when it is signalled: ``pipelines.step_processes``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator

PR_SET_PDEATHSIG = 1
"""``prctl`` option (``linux/prctl.h``): the signal a process gets when its parent dies."""
LOCAL_RUN_PID_ENV = "LINGO_LOCAL_RUN_PID"
"""Set by ``lingo run --local`` on each step it starts (``pipelines.step_processes``): its own
pid. A step started in a process group of its own finds its expected parent from it
(``expected_step_parent``)."""


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere a
    no-op that returns False).

    ``SIGTERM`` (the default) lets the process stop its own children (torchrun stops its
    ranks on SIGTERM); ``SIGKILL`` for processes with nothing to clean up.

    Args:
        sig: The signal.
        parent: The pid the parent had when it started this process: if it is gone already
            (it died before the request took effect), this process exits at once.
    """
    done = False
    if sys.platform.startswith("linux"):
        import ctypes

        done = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    if parent is not None and os.getppid() != parent:  # it died before the request took effect
        os._exit(1)
    return done


def start_step_process(level: int = logging.INFO) -> None:
    """What a pipeline step process does first: ask for SIGTERM when the process that started
    it dies, turn SIGTERM into ``SystemExit(143)`` (so the step unwinds: ``subprocess.run``
    kills the torchrun it waits for, data prep stops its workers, staging folders are
    discarded; a handler installed later, such as a PyTorchJob's deletion, takes precedence
    while it is installed), log at ``level`` with every record redacted
    (``core.redact.configure_logging``), and, in an image that names the oldest NVIDIA
    driver it runs on, stop with one line on a node whose driver is older
    (``core.image_checks.require_supported_driver``)."""
    import threading

    from core.redact import configure_logging

    parent = expected_step_parent()  # read first: the parent may be dying right now
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
    die_with_parent(signal.SIGTERM, parent)  # exits at once if that parent is gone already
    configure_logging(level)
    # imported after the parent-death signal is set: nothing widens that window
    from core.image_checks import ImageCheckError, require_supported_driver

    try:
        require_supported_driver()
    except ImageCheckError as error:
        raise SystemExit(f"error: {error}") from None


def expected_step_parent() -> int:
    """The pid of the process that started this step, as it was when the step was started.

    Under ``lingo run --local`` (``LOCAL_RUN_PID_ENV`` set) the step runs in a process group
    of its own whose leader is kfp.local's ``sh`` (the step's parent) or, where ``sh`` handed
    its process over to the step (``exec``), the step itself, whose parent is then ``lingo``.
    The parent-death signal is asked for only once the step's Python has imported its
    component (seconds after ``sh`` started it): a parent killed in between has already been
    replaced by PID 1 or a subreaper, which this comparison catches. Elsewhere (a pod): the
    parent now.
    """
    run_pid = os.environ.get(LOCAL_RUN_PID_ENV, "")
    if run_pid.isdigit():
        leader = os.getpgrp()
        return int(run_pid) if leader == os.getpid() else leader
    return os.getppid()


def _exit_on_signal(signum: int, frame) -> None:  # noqa: ARG001 (a signal handler's signature)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def on_sigterm(handler: Callable[[int, object], None]) -> Iterator[None]:
    """Within it, SIGTERM calls ``handler(signum, frame)``; the previous handler is restored
    after. Main thread only (``signal.signal``'s rule)."""
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
