"""``lingo serve models:/<name>@champion``: the registry's champion, registered the way the
pipeline's gate registers it (``eval.registry.register_directory`` then ``set_alias``), in a
real local MLflow store (SQLite, what ``lingo run --local`` tracks to), downloaded once into a
cache folder and served as a folder. vLLM is not started: the ``--python`` given is a stand-in
that records the argv and the environment the server would start with, then exits (or answers
``GET /v1/models`` once first, as a started server does). tests/vllm_engines/test_vllm_serve.py
serves with vLLM itself."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.tracking import local_store_uri
from eval.gate import GateConfig
from eval.registry import content_sha256, register_directory, set_alias
from pipelines.cli import app
from pipelines.serve_local import (
    GPT_OSS_TOKEN_IDS,
    GPT_OSS_VOCAB_SIZE,
    ServeError,
    chat_api_problem,
    resolve_model,
)

runner = CliRunner()
GATE = GateConfig()  # the pipeline's registered name and alias: lingo-gpt-oss, champion
CHAMPION = f"models:/{GATE.registered_model}@{GATE.alias}"


def gpt_oss_folder(root: Path, weights: bytes = b"\0" * 64) -> Path:
    """A model folder with gpt-oss's config type, vocabulary size and harmony token ids (the
    files ``model_folder`` reads) and a small safetensors file."""
    import numpy as np
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}
    (root / "config.json").write_text(json.dumps(config | {"vocab_size": GPT_OSS_VOCAB_SIZE}))
    added = [{"id": i, "content": t, "special": True} for t, i in GPT_OSS_TOKEN_IDS.items()]
    (root / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    save_file({"w": np.frombuffer(weights, dtype=np.uint8).copy()}, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """A SQLite store whose ``lingo-gpt-oss`` has version 1 as ``champion`` (one per module:
    creating a store's tables takes seconds)."""
    root = tmp_path_factory.mktemp("registry")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", local_store_uri(root / "store"))
        patch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        model = gpt_oss_folder(root / "grpo-model")
        sha = content_sha256(model)
        metrics = {"both_language_accuracy": 0.9}
        version = register_directory(GATE.registered_model, model, sha, metrics)
        set_alias(GATE.registered_model, GATE.alias, version.version)
    return {"sha": sha, "store": root / "store"}


@pytest.fixture
def registry(store, tmp_path, monkeypatch) -> dict:
    """``store`` as the tracking URI, an empty cache folder; cwd is tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", local_store_uri(store["store"]))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return store | {"cache": tmp_path / "cache"}


def test_the_champion_is_downloaded_once_into_the_cache_and_served_as_a_folder(
    registry, monkeypatch
):
    folder = resolve_model(CHAMPION, registry["cache"])
    assert folder == registry["cache"] / "lingo-gpt-oss" / f"v1-{registry['sha'][:12]}"
    assert content_sha256(folder) == registry["sha"]
    assert os.listdir(folder.parent) == [folder.name]  # no temporary folder left beside it

    def no_download(**kwargs):
        raise AssertionError(f"downloaded again: {kwargs}")

    monkeypatch.setattr("mlflow.artifacts.download_artifacts", no_download)
    assert resolve_model(CHAMPION, registry["cache"]) == folder
    assert resolve_model("models:/lingo-gpt-oss/1", registry["cache"]) == folder


def _stand_in_python(path: Path) -> Path:
    """An executable that records its argv and VLLM_CPU_KVCACHE_SPACE, says why it refuses
    (as vLLM's argument parser does) and exits 3."""
    path.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {path.parent}/argv.txt\n'
        f'printf "%s" "$VLLM_CPU_KVCACHE_SPACE" > {path.parent}/kv.txt\n'
        'echo "api_server.py: error: unrecognized arguments: --stand-in" >&2\n'
        "exit 3\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_lingo_serve_starts_vllm_on_the_champions_folder(registry, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    python = _stand_in_python(tmp_path / "python")
    result = runner.invoke(app, ["serve", CHAMPION, "--python", str(python), "--port", "8123"])
    folder = Path("runs/serve/models") / "lingo-gpt-oss"  # the default cache, under cwd
    (served,) = folder.iterdir()
    assert f"{CHAMPION} is {served}" in result.stdout
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert argv[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(served)]
    options = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert options["--served-model-name"] == "lingo-gpt-oss"
    assert options["--reasoning-parser"] == "openai_gptoss"
    assert options["--port"] == "8123"
    assert (tmp_path / "kv.txt").read_text() == "1"
    assert content_sha256(served) == registry["sha"]
    assert result.exit_code == 1 and "exited with status 3" in result.stderr
    # the server's own last words reach the user (its log's tail)
    assert "error: unrecognized arguments: --stand-in" in result.stderr


@pytest.mark.parametrize(
    "uri, expected",
    [
        (
            "models:/lingo-gpt-oss@challenger",
            "models:/lingo-gpt-oss@challenger: Registered model alias challenger not found",
        ),
        ("models:/nope@champion", "models:/nope@champion: Registered Model with name=nope not"),
        ("models:/lingo-gpt-oss/7", "models:/lingo-gpt-oss/7: Model Version (name=lingo-gpt-oss"),
        ("models:/a/b/c", "models:/a/b/c: Not a proper models:/ URI"),
    ],
)
def test_an_unknown_name_version_or_alias_is_one_line(registry, uri, expected):
    result = runner.invoke(app, ["serve", uri, "--python", "/nonexistent/python"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1, result.stderr
    assert len(errors) == 1 and errors[0].startswith(f"error: {expected}"), result.stderr
    assert "registry sqlite:///" in errors[0] and "Traceback" not in result.stderr
    assert not (Path("runs/serve/models") / "lingo-gpt-oss").exists()


def test_without_a_tracking_uri_a_models_uri_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = runner.invoke(app, ["serve", CHAMPION, "--python", "/nonexistent/python"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {CHAMPION}: no MLFLOW_TRACKING_URI; set it to the registry the pipeline "
        "registered the model in (a local run's: sqlite:///<runs folder>/mlflow.db, as `lingo "
        "run --local` prints)"
    ]


def test_files_that_do_not_match_the_registered_hash_leave_no_folder(registry, tmp_path):
    model = gpt_oss_folder(tmp_path / "other", weights=b"\1" * 64)
    version = register_directory("tampered", model, content_sha256(model), {})
    (weights,) = Path(version.source.removeprefix("file://")).rglob("model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-1] + b"\2")  # the store's copy changed
    with pytest.raises(ServeError, match="do not hash to version 1's lingo.content_sha256"):
        resolve_model("models:/tampered/1", registry["cache"])
    assert list((registry["cache"] / "tampered").iterdir()) == []


STAND_IN_SERVER = """
import http.server, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ('{"data": [{"id": "%s"}]}' % args["--served-model-name"]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer((args["--host"], int(args["--port"])), Models)
if os.environ.get("STAND_IN_PID"):  # serve until stopped, as vLLM does
    open(os.environ["STAND_IN_PID"], "w").write(str(os.getpid()))
    server.serve_forever()
server.handle_request()
"""
"""What the stand-in runs: a server on ``--host``:``--port`` that lists ``--served-model-name``
once, then exits 0 (``lingo serve`` has then printed all it prints once the server is up); with
``$STAND_IN_PID``, writes its pid there and serves until stopped."""


def _stand_in_server(folder: Path) -> Path:
    """An executable that runs ``STAND_IN_SERVER`` with the server's options."""
    import sys

    script = folder / "server.py"
    script.write_text(STAND_IN_SERVER)
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def own_vocabulary_model(tmp_path_factory) -> Path:
    """A tiny gpt-oss model with its own small BPE vocabulary, as the demo's model has: the
    harmony tokens at low ids."""
    from trainer.tiny_model import SMALLEST, build_tiny_model

    corpus = ["Bonjour, le monde. Hello world. Hola mundo."] * 20
    small = SMALLEST.model_copy(update={"vocab_size": 300})
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", small, corpus)


@pytest.mark.parametrize("tokenizer", ["its own", "gpt-oss's"])
def test_lingo_serve_prints_the_eval_command_that_scores_the_model(
    tokenizer, own_vocabulary_model, tmp_path, monkeypatch
):
    """A gpt-oss model with its own vocabulary (the demo's) is served and scored through
    ``/v1/completions``: vLLM's chat endpoint renders gpt-oss chats with o200k_harmony, which
    would give it ids it does not have (HTTP 400 'Token id 200008 is out of vocabulary' to every
    chat); one with gpt-oss's tokenizer keeps the chat API."""
    monkeypatch.chdir(tmp_path)
    python, port = _stand_in_server(tmp_path), _free_port()
    model = own_vocabulary_model if tokenizer == "its own" else gpt_oss_folder(tmp_path / "m")
    result = runner.invoke(app, ["serve", str(model), "--python", str(python), "--port", port])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    url = f"http://127.0.0.1:{port}/v1"
    command = f"score it: lingo eval -m served={url}#lingo-gpt-oss"
    if tokenizer == "gpt-oss's":
        assert command in lines and not [line for line in lines if "o200k" in line]
        return
    assert f"{command} --api completions" in lines
    (why,) = [line for line in lines if "o200k_harmony" in line]
    vocabulary = json.loads((model / "config.json").read_text())["vocab_size"]  # ~300
    assert why == (
        "vLLM's chat endpoint renders gpt-oss chats with o200k_harmony whatever the model's "
        f"tokenizer, and this model's is its own (<|startoftext|> is id 7 of {vocabulary}; "
        "o200k_harmony's is 199998 of 201088): it is scored through /v1/completions instead "
        "(the harmony prompt rendered by `lingo eval --api completions`, tokenized by the "
        "model's own tokenizer)"
    )


def test_a_gpt_oss_model_is_checked_against_gpt_oss_s_tokenizer(own_vocabulary_model, tmp_path):
    assert chat_api_problem(gpt_oss_folder(tmp_path / "gpt-oss")) is None
    assert "this model's is its own" in chat_api_problem(own_vocabulary_model)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert chat_api_problem(tmp_path / "other") is None  # other model types: not checked


def test_sigterm_stops_lingo_serve_and_its_server(tmp_path):
    """``kill <lingo serve>`` (a container's stop, a test's teardown) stops the vLLM server it
    started too, as Ctrl-C does, instead of leaving it running."""
    import signal
    import subprocess
    import sys
    import time

    python, port = _stand_in_server(tmp_path), _free_port()
    model = gpt_oss_folder(tmp_path / "m")
    serve = subprocess.Popen(
        [sys.executable, "-m", "pipelines", "serve", str(model), "--python", str(python),
         "--port", str(port), "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "STAND_IN_PID": str(tmp_path / "pid")},
    )  # fmt: skip
    pid = None
    try:
        for line in serve.stdout:
            if line.startswith("score it: "):
                break
        pid = int((tmp_path / "pid").read_text())
        serve.send_signal(signal.SIGTERM)
        status = serve.wait(60)
        time.sleep(0.5)  # a stray server would still answer by now
        left = _running(pid)
    finally:
        serve.kill()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)  # this test's own stand-in, never left behind
    assert status == 0 and not left  # lingo serve stopped (and reaped) its server first


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
