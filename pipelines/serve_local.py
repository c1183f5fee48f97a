"""``lingo serve``: a model folder (a run's exported GRPO model), or the registry's champion
(``models:/lingo-gpt-oss@champion``, downloaded once into a cache folder), behind vLLM's
OpenAI-compatible server on this machine, as the cluster serves it (``cluster.serving``: the
same reasoning parser and served name), for ``lingo eval -m served=URL#NAME``: through the chat
API for a model with gpt-oss's tokenizer, through ``/v1/completions`` (``--api completions``)
for one with its own (``chat_api_problem``: the tiny demo model's).

vLLM cannot sit in the main environment beside CPU torch; the server runs in the vLLM
environment ``make test-vllm`` builds (``.venv-vllm``, vLLM's CPU build, tools/vllm_env.sh),
or any Python given with ``--python`` / ``$LINGO_VLLM_PYTHON`` that has vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from cluster.serving import REASONING_PARSER
from core.processes import on_sigterm

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "LINGO_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_NAME = "lingo-gpt-oss"
MODELS_URI_PREFIX = "models:/"
DEFAULT_CACHE = Path("runs/serve/models")
"""Where ``lingo serve models:/…`` keeps the registered versions it downloaded."""

GPT_OSS_TOKEN_IDS = {
    "<|startoftext|>": 199_998,
    "<|endoftext|>": 199_999,
    "<|return|>": 200_002,
    "<|constrain|>": 200_003,
    "<|channel|>": 200_005,
    "<|start|>": 200_006,
    "<|end|>": 200_007,
    "<|message|>": 200_008,
    "<|call|>": 200_012,
}
"""The harmony tokens' ids in gpt-oss's tokenizer (``o200k_harmony``). vLLM's chat endpoint
does not render a gpt-oss chat with the model's tokenizer: for ``model_type == "gpt_oss"`` it
renders with ``openai_harmony``'s o200k_harmony encoding and parses the reply with it
(``vllm/renderers/online_renderer.py``, ``use_harmony``), so a model whose tokenizer is not
gpt-oss's gets ids it does not know (``Token id 200008 is out of vocabulary``, HTTP 400 to every
chat request: ``vllm/renderers/base.py``, ``validate_token_ids``). Its ``/v1/completions``
tokenizes a text prompt with the model's own tokenizer (``OnlineRenderer.render_completion``,
the ``hf`` renderer), whatever the model type."""
GPT_OSS_VOCAB_SIZE = 201_088
"""gpt-oss's ``vocab_size`` (o200k_harmony's ids end at ``<|reserved_201087|>``)."""


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


def chat_api_problem(path: Path) -> str | None:
    """Why vLLM's chat endpoint cannot render chats for the gpt-oss model in ``path`` (its
    tokenizer is not gpt-oss's: ``GPT_OSS_TOKEN_IDS``), or ``None``; other model types are not
    checked."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "gpt_oss":
        return None
    renders = "vLLM's chat endpoint renders gpt-oss chats with o200k_harmony whatever the model's"
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        return f"{renders} tokenizer, and this model has no tokenizer.json to check it against"
    added = json.loads(tokenizer_file.read_text(encoding="utf-8")).get("added_tokens") or []
    ids = {token.get("content"): token.get("id") for token in added}
    wrong = [name for name, wanted in GPT_OSS_TOKEN_IDS.items() if ids.get(name) != wanted]
    vocab_size = config.get("vocab_size") or 0
    if not wrong and vocab_size >= GPT_OSS_VOCAB_SIZE:
        return None
    name = wrong[0] if wrong else "<|message|>"
    return (
        f"{renders} tokenizer, and this model's is its own ({name} is id {ids.get(name)} of "
        f"{vocab_size}; o200k_harmony's is {GPT_OSS_TOKEN_IDS[name]} of {GPT_OSS_VOCAB_SIZE})"
    )


def resolve_model(model: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The model folder to serve: ``model`` itself, or for an MLflow model URI
    (``models:/<name>@<alias>``, ``models:/<name>/<version>``) the registered version's files,
    downloaded once into ``cache_dir`` (``registered_model_folder``).

    Raises:
        ServeError: not a model folder, or the registry cannot give the version (one line).
    """
    if model.startswith(MODELS_URI_PREFIX):
        return model_folder(registered_model_folder(model, cache_dir))
    return model_folder(Path(model))


def registered_model_folder(uri: str, cache_dir: Path) -> Path:
    """The files of the version ``uri`` names, in ``cache_dir/<name>/v<version>-<key>``.

    ``key`` is the version's content hash (``lingo.content_sha256``, which the gate's
    ``register`` step sets; checked after the download) or, without one, a hash of its source
    URI, so a folder is never a different registry's version of the same number. A version
    already there is not downloaded again; a download goes to a temporary folder beside it
    and is renamed into place, so a folder that exists is complete.

    Raises:
        ServeError: no ``MLFLOW_TRACKING_URI``, an improper URI, an unknown name, version or
            alias, or files that do not match the registered content hash.
    """
    from core.tracking import tracking_enabled

    if not tracking_enabled():
        raise ServeError(
            f"{uri}: no MLFLOW_TRACKING_URI; set it to the registry the pipeline registered "
            "the model in (a local run's: sqlite:///<runs folder>/mlflow.db, as `lingo run "
            "--local` prints)"
        )
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    from core.redact import redact
    from eval.registry import HASH_TAG, content_sha256

    client = MlflowClient()
    registry = redact(os.environ["MLFLOW_TRACKING_URI"])
    try:
        resolved = get_model_name_and_version(client, uri)
        if len(resolved) != 2:  # models:/<id>: a logged model, not a registered version
            raise ServeError(
                f"{uri}: not a registered model; give models:/<name>@<alias> or "
                "models:/<name>/<version>, e.g. models:/lingo-gpt-oss@champion"
            )
        name, number = resolved
        version = client.get_model_version(name, number)
    except MlflowException as exc:
        message = " ".join(exc.message.split()).rstrip(".")
        raise ServeError(f"{uri}: {message} (registry {registry})") from None
    sha = (version.tags or {}).get(HASH_TAG)
    key = sha[:12] if sha else hashlib.sha256(version.source.encode()).hexdigest()[:12]
    target = cache_dir / name / f"v{version.version}-{key}"
    if target.is_dir():
        log.info("%s: version %s, cached in %s", uri, version.version, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: downloading version %s (%s) into %s", uri, version.version, version.source,
             target)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as work:
        local = Path(
            download_artifacts(artifact_uri=f"models:/{name}/{version.version}", dst_path=work)
        )
        if sha and content_sha256(local) != sha:
            raise ServeError(
                f"{uri}: the files downloaded from {version.source} do not hash to version "
                f"{version.version}'s {HASH_TAG} ({sha[:12]}…): the registry's artifacts "
                "changed after registration"
            )
        try:
            os.replace(local, target)  # same file system: a rename
        except OSError:
            if not target.is_dir():  # else another `lingo serve` put it there first
                raise
            shutil.rmtree(local, ignore_errors=True)
    return target


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
    """A started vLLM server: its process, OpenAI base URL (``…/v1``), served name, log, and
    the API ``lingo eval`` scores it through (``EndpointSettings.api``)."""

    process: subprocess.Popen
    base_url: str
    name: str
    log_path: Path
    api: str = "chat"

    @property
    def eval_model(self) -> str:
        """What ``lingo eval -m`` takes for it."""
        return f"served={self.base_url}#{self.name}"

    @property
    def eval_command(self) -> str:
        """The ``lingo eval`` command line that scores it."""
        api = "" if self.api == "chat" else f" --api {self.api}"
        return f"lingo eval -m {self.eval_model}{api}"

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
    api: str = "chat",
) -> LocalServer:
    """Start ``command`` (``server_command``) and wait until ``GET {base_url}/models`` lists
    ``name``; ``api``: the API it is scored through (``completions`` where its model has a
    ``chat_api_problem``).

    Raises:
        ServeError: the server exited or was not ready in time (with its log's last lines).
    """
    env = server_env()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = LocalServer(process, base_url, name, log_path, api)
    deadline = time.monotonic() + ready_timeout_s
    try:
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
    except BaseException:  # interrupted while it starts (Ctrl-C, SIGTERM): no server left
        server.stop()
        raise
    server.stop()
    raise ServeError(
        f"vLLM's server not ready after {ready_timeout_s:.0f} s ({log_path}):\n" + _tail(log_path)
    )


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM (``kill``, a container's stop) interrupts the main thread as Ctrl-C
    does, so that ``lingo serve`` stops its vLLM server rather than leave it running; the
    previous handler is restored after."""

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    with on_sigterm(interrupt):
        yield


def server_env() -> dict[str, str]:
    """The server's environment: this one, and a 1 GiB KV cache on vLLM's CPU build unless
    ``VLLM_CPU_KVCACHE_SPACE`` says otherwise (else it is sized from host RAM)."""
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
