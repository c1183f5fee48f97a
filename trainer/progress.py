"""The training progress OpenShift AI shows, served live by the primary training process.

A TrainJob marked for progression tracking (``trainer.opendatahub.io/progression-tracking``)
is polled by the platform's controller: ``GET http://<primary pod>:<port>/metrics`` every poll
interval, and the object it answers becomes the TrainJob's ``trainerStatus`` annotation (what
the dashboard draws). At the end of training the same object goes to the container's
termination message, which the controller reads when the pod is gone. docs/platform.md
("Progress in OpenShift AI") holds the contract.

When ``LINGO_PROGRESS_PORT`` is set, global rank 0 of SFT and GRPO serves that object on
``0.0.0.0:<port>`` (any path answers; the controller asks ``/metrics``) from a daemon thread;
training never waits for it. The object is computed from the lines ``MetricsWriter`` writes to
``training_metrics.jsonl`` (``progress_object``), as the Open Data Hub Kubeflow SDK computes it
from that file for training_hub's ``lora_grpo`` algorithm: progress ``round(100 × step /
max_steps)`` held at 99 until the last step, ``ETA = int(wall_time_s / step × (max_steps −
step))``, ``currentEpoch = max(1, ceil(epoch))``, train metrics as strings with 4 decimals (the
learning rate 6). On top of it: ``totalEpochs`` is the run's planned epochs (the SDK writes 1
for GRPO, nothing for SFT), and ``evalMetrics`` holds the latest held-out figures (the SDK's
are always empty).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

PORT_ENV = "LINGO_PROGRESS_PORT"
"""Set on the training pod when progress tracking is on: the port to serve on."""
TERMINATION_PATH_ENV = "LINGO_TERMINATION_MESSAGE_PATH"
"""Where the final object goes (default: Kubernetes' ``/dev/termination-log``)."""
DEFAULT_TERMINATION_PATH = "/dev/termination-log"

TRAIN_METRICS = {
    "loss": 4,
    "learning_rate": 6,
    "grad_norm": 4,
    "mean_reward": 4,
    "full_match_rate": 4,
    "entropy": 4,
}
"""Train figures served (those a line carries), with their decimals: the SDK's GRPO set."""
EVAL_METRICS = (
    "eval_loss",
    "eval_mean_reward",
    "eval_both_language_accuracy",
    "eval_real_word_share",
)
"""Held-out figures served (SFT: the eval loss; GRPO: reward, language accuracy, real words)."""


def format_metric(value, decimals: int = 4) -> str | None:
    """A metric as the SDK serves it: a string with ``decimals`` decimals; None when missing,
    boolean or not finite."""
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return f"{number:.{decimals}f}" if math.isfinite(number) else None


def progress_object(
    line: dict | None, planned_epochs: float | None, eval_metrics: dict | None = None
) -> dict:
    """The progress object for the latest metrics line (None: no line yet).

    Args:
        line: the last line of ``training_metrics.jsonl`` (eval values merged onto it).
        planned_epochs: the epochs ``max_steps`` stand for (``totalEpochs`` is its ceiling).
        eval_metrics: the latest held-out figures, already formatted (``evalMetrics``).
    """
    total_epochs = max(1, math.ceil(planned_epochs)) if planned_epochs else None
    if line is None:
        return {
            "progressPercentage": None,
            "estimatedRemainingSeconds": None,
            "currentStep": 0,
            "totalSteps": None,
            "currentEpoch": 0.0,
            "totalEpochs": total_epochs,
            "trainMetrics": {},
            "evalMetrics": dict(eval_metrics or {}),
        }
    step, max_steps = int(line.get("step", 0)), line.get("max_steps")
    percent = None
    if max_steps:
        percent = int(round(step / max_steps * 100))
        percent = min(99, percent) if step < max_steps else min(100, percent)
    wall = line.get("wall_time_s")
    eta = None
    if max_steps and step > 0 and wall and wall > 0:
        eta = int(wall / step * (max_steps - step)) if max_steps > step else 0
    return {
        "progressPercentage": percent,
        "estimatedRemainingSeconds": eta,
        "currentStep": step,
        "totalSteps": max_steps or None,
        "currentEpoch": float(max(1, math.ceil(line.get("epoch") or 0))),
        "totalEpochs": total_epochs,
        "trainMetrics": {
            key: format_metric(line[key], decimals)
            for key, decimals in TRAIN_METRICS.items()
            if key in line
        },
        "evalMetrics": dict(eval_metrics or {}),
    }


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps(self.server.progress.current()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        log.debug("progress server: " + format, *args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    progress: ProgressServer


class ProgressServer:
    """The latest progress object, served over HTTP from a daemon thread.

    ``update`` (called by ``MetricsWriter`` for every line it writes) and the request
    handler share the object under a lock; a request never waits for training.

    Args:
        port: the TCP port (0: any free port, see ``port``).
        host: the address to bind (every interface by default: the controller polls the
            pod's IP).
        termination_path: where ``finish`` writes the final object.
    """

    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        termination_path: str | Path = DEFAULT_TERMINATION_PATH,
    ) -> None:
        self.termination_path = Path(termination_path)
        self._lock = threading.Lock()
        self._line: dict | None = None
        self._planned_epochs: float | None = None
        self._eval: dict[str, str | None] = {}
        self._http = _Server((host, port), _Handler)
        self._http.progress = self
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="progress-server",
            daemon=True,
        )
        self._thread.start()

    def update(self, line: dict, planned_epochs: float) -> None:
        """Take a metrics line (the newest, or the newest rewritten with eval values)."""
        with self._lock:
            self._line, self._planned_epochs = dict(line), planned_epochs
            for key in EVAL_METRICS:
                if line.get(key) is not None:
                    self._eval[key] = format_metric(line[key])

    def current(self) -> dict:
        """The progress object now."""
        with self._lock:
            return progress_object(self._line, self._planned_epochs, self._eval)

    def finish(self) -> bool:
        """Write the final object to the termination message; True when written.

        Only into a file that exists and is writable: the kubelet mounts it into the
        container; elsewhere (a laptop, a test without the file) nothing is written. The
        file is written in place (it is a mount point: it cannot be renamed over).
        """
        path = self.termination_path
        if not path.is_file() or not os.access(path, os.W_OK):
            log.info("no writable termination message file %s: final progress not written", path)
            return False
        # compact: Kubernetes keeps 4096 bytes of it; the served keys are bounded (~0.4 KB)
        message = json.dumps(self.current(), separators=(",", ":"))
        try:
            path.write_text(message)
        except OSError as exc:  # training succeeded: that stands
            log.warning("final progress not written to %s: %s", path, exc)
            return False
        return True

    def close(self) -> None:
        """Stop serving and free the port."""
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()


def port_from_env() -> int | None:
    """``LINGO_PROGRESS_PORT`` as a port number (None when unset or empty).

    Raises:
        ValueError: the value is not a port number.
    """
    value = os.environ.get(PORT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{PORT_ENV}={value!r} is not a TCP port: set it to 1-65535 or unset it")
    return int(value)


@contextlib.contextmanager
def serve_progress(is_main: bool = True) -> Iterator[ProgressServer | None]:
    """The progress server of one training run, when ``LINGO_PROGRESS_PORT`` is set (rank 0).

    A run that ends normally writes the final object to the termination message
    (``LINGO_TERMINATION_MESSAGE_PATH``, default ``/dev/termination-log``); a failing run does
    not, so Kubernetes keeps the log tail there. The server stops either way. A port that
    cannot be bound is reported and training goes on without the server.

    Raises:
        ValueError: ``LINGO_PROGRESS_PORT`` is not a port number.
    """
    port = port_from_env() if is_main else None
    if port is None:
        yield None
        return
    termination = os.environ.get(TERMINATION_PATH_ENV) or DEFAULT_TERMINATION_PATH
    try:
        server = ProgressServer(port, termination_path=termination)
    except OSError as exc:
        log.warning("progress server not started on port %d (%s): training goes on", port, exc)
        yield None
        return
    log.info("progress server on port %d (GET /metrics)", server.port)
    try:
        yield server
        server.finish()
    finally:
        server.close()
