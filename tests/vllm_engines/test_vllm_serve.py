"""``lingo serve`` on vLLM's CPU build: the tiny model, with gpt-oss's tokenizer, behind vLLM's
OpenAI-compatible server (gpt-oss's reasoning parser, as the cluster's InferenceService runs
it), scored by the eval's endpoint client, gives the in-process eval's both-language figure
within its interval (same questions, samples and seeds). Skipped where vLLM is missing;
``make test-vllm`` runs it."""

from __future__ import annotations

import socket
import sys

import pytest

from eval.eval_config import EvalConfig, SamplingSettings
from eval.report import load_results
from eval.runner import run_eval
from pipelines.serve_local import ServeError, model_folder, server_command, start_server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _overall(results_dir, label: str) -> dict:
    (model,) = [m for m in load_results(results_dir)["models"] if m["label"] == label]
    return model["summary"]["overall"]


def test_the_served_model_scores_what_the_in_process_eval_scores(tmp_path, harmony_model_dir):
    """On the tiny model with gpt-oss's tokenizer: vLLM's server renders a gpt-oss chat with
    o200k_harmony whatever the model's tokenizer (the tiny model's own BPE gets id 200008 and
    every request answered 400 'Token id 200008 is out of vocabulary': ``lingo serve`` refuses
    it, tests/pipelines/test_serve.py)."""
    sampling = SamplingSettings(max_tokens=48, n=2, seed=3)
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


def test_a_server_that_cannot_start_says_why(tmp_path, harmony_model_dir):
    command = server_command(model_folder(harmony_model_dir), sys.executable, port=_free_port())
    command += ["--no-such-option"]
    with pytest.raises(ServeError, match="exited with status"):
        start_server(command, "http://127.0.0.1:1/v1", "x", tmp_path / "log", ready_timeout_s=120)
