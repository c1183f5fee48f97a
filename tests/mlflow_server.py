"""A real ``mlflow server`` on 127.0.0.1 (sqlite backend, proxied local artifacts), for tests.

The server needs the full ``mlflow`` distribution's server dependencies (sqlalchemy, alembic,
huey, graphene, aiohttp, ...), not only ``mlflow-skinny``. It is started in its own process
group (it forks uvicorn workers and a job consumer) and that group is stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import free_port

START_TIMEOUT_S = 180.0  # a loaded 2-core machine starts the server in 60-120 s
STOP_GRACE_S = 2.0


def _mlflow_executable() -> str:
    beside = Path(sys.executable).parent / "mlflow"
    return str(beside) if beside.exists() else (shutil.which("mlflow") or "mlflow")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group; SIGKILL what is left after a short grace period
    (a graceful uvicorn shutdown takes several seconds and the data is thrown away anyway)."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # workers may outlive the group leader
        os.killpg(proc.pid, signal.SIGKILL)


def wait_healthy(
    url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Return once ``url/health`` answers 200.

    Raises:
        RuntimeError: The process ended, or ``timeout_s`` passed (the log tail is quoted).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"mlflow server did not start on {url}:\n{tail}")
        time.sleep(0.25)


@contextmanager
def mlflow_server(root: str | Path | None = None) -> Iterator[str]:
    """Start ``mlflow server`` on a free loopback port; yield its URL; stop it.

    Args:
        root: Directory for the sqlite database, the artifacts and the server log; default: a
            new temporary directory, removed afterwards.

    Raises:
        RuntimeError: The server did not answer ``/health`` in time (the log tail is quoted).
    """
    owned = root is None
    base = Path(tempfile.mkdtemp(prefix="mlflow-server-")) if owned else Path(root)
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = base / "server.log"
    command = [
        _mlflow_executable(),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{base / 'mlflow.db'}",
        "--artifacts-destination",
        str(base / "artifacts"),
        "--allowed-hosts",
        f"127.0.0.1:{port},localhost:{port}",
    ]
    # no job runner (huey consumers): the tests use tracking and the registry only
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=base,
            env=env,
            start_new_session=True,
        )
    try:
        wait_healthy(url, proc, log_path)
        yield url
    finally:
        stop(proc)
        if owned:
            shutil.rmtree(base, ignore_errors=True)
