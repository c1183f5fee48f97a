"""``lingo serve``: a model folder (a run's exported GRPO model, the champion) behind vLLM's
OpenAI-compatible server on this machine, as the cluster serves it (``cluster.serving``: the
same reasoning parser and served name), for ``lingo eval -m served=URL#NAME``.

vLLM cannot sit in the main environment beside CPU torch; the server runs in the vLLM
environment ``make test-vllm`` builds (``.venv-vllm``, vLLM's CPU build, tools/vllm_env.sh),
or any Python given with ``--python`` / ``$LINGO_VLLM_PYTHON`` that has vLLM.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from cluster.serving import REASONING_PARSER

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "LINGO_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_NAME = "lingo-gpt-oss"


class ServeError(RuntimeError):
    """The server could not start; the message names why and where its log is."""


def vllm_python(given: str | None = None) -> str:
    """The Python that runs vLLM: ``given``, else ``$LINGO_VLLM_PYTHON``, else the repo's
    ``.venv-vllm``, else this interpreter."""
    if given:
        return given
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.environ[VLLM_PYTHON_ENV]
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def model_folder(path: Path) -> Path:
    """``path`` when it is a HF model folder (``config.json`` and weights).

    Raises:
        ServeError: it is not (one line naming what is missing).
    """
    if not (path / "config.json").is_file():
        raise ServeError(
            f"{path}: no config.json; give a model folder, e.g. the grpo_model path "
            "`lingo run --local` prints (…/export-hf/model)"
        )
    if not any(path.glob("*.safetensors")):
        raise ServeError(f"{path}: no *.safetensors weights")
    return path


def server_command(
    model_dir: Path,
    python: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str = DEFAULT_NAME,
    max_model_len: int = 2048,
    cpu: bool = True,
    dtype: str = "auto",
) -> list[str]:
    """The ``vllm.entrypoints.openai.api_server`` command line.

    On vLLM's CPU build chunked prefill is off (a seeded request it splits crashes the
    engine: ``generation.vllm.vllm_scheduling_kwargs``) and a step holds a whole sequence.
    """
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--reasoning-parser",
        REASONING_PARSER,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--seed",
        "0",
    ]
    if cpu:
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
    return command


@dataclass
class LocalServer:
    """A started vLLM server: its process, OpenAI base URL (``…/v1``), served name, log."""

    process: subprocess.Popen
    base_url: str
    name: str
    log_path: Path

    @property
    def eval_model(self) -> str:
        """What ``lingo eval -m`` takes for it."""
        return f"served={self.base_url}#{self.name}"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    command: list[str],
    base_url: str,
    name: str,
    log_path: Path,
    ready_timeout_s: float = 600.0,
) -> LocalServer:
    """Start ``command`` (``server_command``) and wait until ``GET {base_url}/models`` lists
    ``name``.

    Raises:
        ServeError: the server exited or was not ready in time (with its log's last lines).
    """
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else sized from host RAM
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = LocalServer(process, base_url, name, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServeError(
                f"vLLM's server exited with status {process.returncode} ({log_path}):\n"
                + _tail(log_path)
            )
        try:
            models = requests.get(f"{base_url}/models", timeout=5).json().get("data") or []
            if any(m.get("id") == name for m in models):
                return server
        except (requests.RequestException, ValueError):
            pass
        time.sleep(1.0)
    server.stop()
    raise ServeError(
        f"vLLM's server not ready after {ready_timeout_s:.0f} s ({log_path}):\n" + _tail(log_path)
    )


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
