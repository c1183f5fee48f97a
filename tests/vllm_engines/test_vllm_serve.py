"""``lingo serve`` on vLLM's CPU build, behind vLLM's OpenAI-compatible server (gpt-oss's
reasoning parser, as the cluster's InferenceService runs it), scored by the eval's endpoint
clients, gives the in-process eval's both-language figure within its interval (same questions,
samples and seeds): the tiny model with gpt-oss's tokenizer through the chat API, and the
demo's model (its own vocabulary) registered as the champion, through ``/v1/completions``.
Skipped where vLLM is missing; ``make test-vllm`` runs it."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from eval.eval_config import EvalConfig, SamplingSettings
from eval.report import load_results
from eval.runner import run_eval
from pipelines.serve_local import ServeError, model_folder, server_command, start_server

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _overall(results_dir, label: str) -> dict:
    (model,) = [m for m in load_results(results_dir)["models"] if m["label"] == label]
    return model["summary"]["overall"]


def test_the_served_model_scores_what_the_in_process_eval_scores(tmp_path, harmony_model_dir):
    """On the tiny model with gpt-oss's tokenizer, through the chat API: vLLM's server renders a
    gpt-oss chat with o200k_harmony whatever the model's tokenizer (the tiny model's own BPE
    gets id 200008 and every chat answered 400 'Token id 200008 is out of vocabulary': it is
    scored through /v1/completions, the next test)."""
    # top_p 1: no nucleus sort of o200k's 201k-entry vocabulary at every step (vLLM's CPU
    # sampler spent 16 s of the in-process eval's 25 s of generation sorting it)
    sampling = SamplingSettings(max_tokens=48, n=2, seed=3, top_p=1.0)
    # 10 questions (2 problems in the 5 languages) × 2 samples: the comparison's footing is
    # the same questions, samples and seeds on both sides, whatever their number
    in_process = EvalConfig(
        engine="vllm",
        dtype="float32",
        sampling=sampling,
        vllm_max_num_batched_tokens=2048,
        limit=10,
    )
    run_eval([f"tiny={harmony_model_dir}"], in_process, tmp_path / "in-process")

    port = _free_port()
    command = server_command(
        model_folder(harmony_model_dir), sys.executable, port=port, cpu=True, dtype="float32"
    )
    assert command[command.index("--reasoning-parser") + 1] == "openai_gptoss"
    server = start_server(
        command, f"http://127.0.0.1:{port}/v1", "lingo-gpt-oss", tmp_path / "vllm.log"
    )
    try:
        run_eval([server.eval_model], EvalConfig(sampling=sampling, limit=10), tmp_path / "served")
    finally:
        server.stop()

    served = load_results(tmp_path / "served")["responses"]
    assert len(served) == 20 and not [r for r in served if r["error"]]
    both = _overall(tmp_path / "in-process", "tiny")["both_language_accuracy"]
    theirs = _overall(tmp_path / "served", "served")["both_language_accuracy"]
    assert both["low"] <= theirs["value"] <= both["high"], (both, theirs)
    assert theirs["low"] <= both["value"] <= theirs["high"], (both, theirs)


def test_the_test_models_tokenizer_is_gpt_oss_s(harmony_model_dir):
    """The tokenizer the in-process engine encodes ``core.harmony``'s text with gives, token for
    token, the ids openai-harmony renders the same conversation to (what vLLM's server feeds
    the model), and ``lingo serve`` accepts the model."""
    import openai_harmony as h
    from harmony_tokenizer import harmony_encoding
    from transformers import AutoTokenizer

    from core.harmony import render_completion, render_prompt

    instructions = "reasoning language: French\nanswer language: German"
    user, analysis, final = (
        "Wie viele Minuten hat ein Tag? 12345 naïve — it's\n\n x",
        "Il y a 24 heures.",
        "1440 Minuten.",
    )
    conversation = h.Conversation.from_messages(
        [
            h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
            h.Message.from_role_and_content(
                h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(instructions)
            ),
            h.Message.from_role_and_content(h.Role.USER, user),
            h.Message.from_role_and_content(h.Role.ASSISTANT, analysis).with_channel("analysis"),
            h.Message.from_role_and_content(h.Role.ASSISTANT, final).with_channel("final"),
        ]
    )
    theirs = harmony_encoding().render_conversation_for_training(
        conversation, h.RenderConversationConfig(auto_drop_analysis=False)
    )
    tokenizer = AutoTokenizer.from_pretrained(harmony_model_dir)
    text = render_prompt(instructions, user) + render_completion(analysis, final)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(theirs)
    assert model_folder(harmony_model_dir) == harmony_model_dir


def test_a_folder_without_a_model_is_one_clear_line(tmp_path):
    with pytest.raises(ServeError, match="no config.json"):
        model_folder(tmp_path)


def test_the_demo_s_champion_served_scores_what_the_in_process_eval_scores(
    tmp_path, demo_model_dir, monkeypatch
):
    """The demo's model (its own vocabulary, which vLLM's chat endpoint cannot render for)
    registered as the champion as the gate registers it, served by ``lingo serve
    models:/lingo-gpt-oss@champion`` and scored by the ``lingo eval`` command it prints
    (``--api completions``): vLLM tokenized the prompt as the in-process engine does (the
    same ids), and with the same questions, samples and per-response seeds the served eval's
    responses are the in-process vLLM eval's, text for text, so its both-language figure lies
    within the other's interval."""
    import os
    import signal
    import subprocess

    import requests
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from core.tracking import local_store_uri
    from eval.gate import GateConfig
    from eval.registry import content_sha256, register_directory, set_alias
    from eval.runner import build_requests, load_questions
    from generation.endpoint import CompletionsEndpointEngine
    from pipelines.cli import app

    gate = GateConfig()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", local_store_uri(tmp_path / "store"))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    sha = content_sha256(demo_model_dir)
    version = register_directory(gate.registered_model, demo_model_dir, sha, {})
    set_alias(gate.registered_model, gate.alias, version.version)

    champion = f"models:/{gate.registered_model}@{gate.alias}"
    port = _free_port()
    # vLLM's CPU build binds each engine's threads to the same first core by default: the
    # server gets the last one, so that it starts while the in-process engine starts
    last_core = str(max(os.sched_getaffinity(0)))
    serve = subprocess.Popen(
        [sys.executable, "-m", "pipelines", "serve", champion, "--python", sys.executable,
         "--port", str(port), "--cache-dir", str(tmp_path / "cache"),
         "--log-file", str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": last_core},
    )  # fmt: skip
    # what `lingo eval` samples with by default (its seed 0), 10 questions × 2 samples
    sampling = SamplingSettings(max_tokens=48, n=2)
    in_process = EvalConfig(
        engine="vllm", dtype="float32", sampling=sampling, vllm_max_num_batched_tokens=2048,
        limit=10,
    )  # fmt: skip
    try:
        run_eval([f"demo={demo_model_dir}"], in_process, tmp_path / "in-process")  # meanwhile
        printed = []
        for line in serve.stdout:  # until `lingo serve` prints the command that scores it
            printed.append(line.rstrip("\n"))
            if line.startswith("score it: "):
                break
        assert printed and printed[-1].startswith("score it: "), "\n".join(printed)
        assert any("o200k_harmony" in line for line in printed), printed  # the one line why
        command = printed[-1].removeprefix("score it: ").split()
        url = f"http://127.0.0.1:{port}/v1"
        assert command == [
            "lingo", "eval", "-m", f"served={url}#{gate.registered_model}", "--api", "completions"
        ]  # fmt: skip

        # the prompt's ids on the server are the model's tokenizer's ids of the rendered prompt
        (_, _, request), *_ = build_requests(load_questions(limit=1), in_process)
        client = CompletionsEndpointEngine(url, gate.registered_model)
        body = client._body(request, sampling.params) | {"return_token_ids": True}
        reply = requests.post(f"{url}/completions", json=body, timeout=120).json()
        tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
        ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
        assert reply["choices"][0]["prompt_token_ids"] == ids
        assert tokenizer.convert_tokens_to_ids("<|message|>") in ids and max(ids) < 4096

        options = ["--samples", "2", "--max-tokens", "48", "--limit", "10"]
        result = CliRunner().invoke(app, [*command[1:], *options, "-o", str(tmp_path / "served")])
        assert result.exit_code == 0, result.output
    finally:
        serve.send_signal(signal.SIGTERM)  # lingo serve stops its server, as on Ctrl-C
        serve.wait(60)
    results = load_results(tmp_path / "served")
    assert results["config"]["sampling"] == in_process.sampling.model_dump()
    served = results["responses"]
    assert len(served) == 20 and not [r for r in served if r["error"]]
    ours = load_results(tmp_path / "in-process")["responses"]
    assert {(r["id"], r["sample"]): r["text"] for r in served} == {
        (r["id"], r["sample"]): r["text"] for r in ours
    }
    both = _overall(tmp_path / "in-process", "demo")["both_language_accuracy"]
    theirs = _overall(tmp_path / "served", "served")["both_language_accuracy"]
    assert both["low"] <= theirs["value"] <= both["high"], (both, theirs)
    assert theirs["low"] <= both["value"] <= theirs["high"], (both, theirs)
