"""Shared test helpers: rows in the Multilingual-Thinking schema, a tiny GPT-OSS model."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

TEXTS = {
    "English": (
        "Let me think about what the user needs and answer briefly.",
        "Here is a short answer.",
    ),
    "French": (
        "Je réfléchis à ce que demande l'utilisateur et je réponds brièvement.",
        "Voici une réponse.",
    ),
    "German": (
        "Ich überlege, was der Nutzer braucht, und antworte kurz und klar.",
        "Hier ist die Antwort.",
    ),
    "Spanish": (
        "Pienso en lo que necesita el usuario y respondo de forma breve.",
        "Aquí está la respuesta.",
    ),
    "Italian": (
        "Penso a ciò che chiede l'utente e rispondo in modo breve e chiaro.",
        "Ecco la risposta.",
    ),
}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a server started right after can bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_row(
    reasoning_language: str = "French",
    user: str = "How many minutes are there in three and a half hours?",
    developer: str = "You are a helpful assistant.",
    analysis: str | None = None,
    final: str = "There are 210 minutes in three and a half hours.",
) -> dict:
    """A valid row in the exact Multilingual-Thinking schema."""
    if analysis is None:
        analysis = TEXTS.get(reasoning_language, TEXTS["English"])[0]
    return {
        "reasoning_language": reasoning_language,
        "developer": developer,
        "user": user,
        "analysis": analysis,
        "final": final,
        "messages": [
            {
                "content": f"reasoning language: {reasoning_language}\n\n{developer}",
                "role": "system",
                "thinking": None,
            },
            {"content": user, "role": "user", "thinking": None},
            {"content": final, "role": "assistant", "thinking": analysis},
        ],
    }


def make_rows(per_language: int) -> list[dict]:
    """``per_language`` distinct valid rows for each of the five languages."""
    rows = []
    for lang in TEXTS:
        for i in range(per_language):
            rows.append(
                make_row(lang, user=f"Question number {i} about {lang} grammar and spelling?")
            )
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts, or raw strings written as-is) as JSON Lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture
def rows_factory():
    return make_rows


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory):
    """train.jsonl / eval.jsonl from the bundled sample (data prep, built once a session)."""
    from data_prep.config import DataPrepConfig  # lazily: the Megatron env lacks data prep's
    from data_prep.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data")
    prepare_dataset(
        DataPrepConfig(workers=1), out / "train.jsonl", out / "eval.jsonl", out / "quarantine.jsonl"
    )
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small tiny-GPT-OSS directory (smaller than the demo's, for fast tests), built once."""
    from trainer.tiny_model import SMALLEST, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", SMALLEST)


@pytest.fixture(scope="session")
def mxfp4_model(tmp_path_factory):
    """``(directory, originals)``: a tiny GPT-OSS written as the hub ships gpt-oss (MXFP4
    experts, ``tests/mxfp4_checkpoint.py``), and the bf16 expert matrices a loader must give
    back. Its experts are not square (intermediate 96, hidden 64), so a transposed matrix
    cannot pass for the right one."""
    from mxfp4_checkpoint import write_mxfp4_checkpoint

    from trainer.tiny_model import SMALLEST, build_tiny_model

    root = tmp_path_factory.mktemp("mxfp4")
    source = build_tiny_model(root / "bf16", SMALLEST.model_copy(update={"intermediate_size": 96}))
    originals = write_mxfp4_checkpoint(source, root / "mxfp4")
    return root / "mxfp4", originals


FAST_LOCAL_RUN = {
    "model.tiny.hidden_size": "64",
    "model.tiny.intermediate_size": "64",
    "model.tiny.vocab_size": "600",
    "sft.max_steps": "3",
    "sft.eval_every": "0",
    "sft.checkpoint_every": "0",
    "sft.eval_max_examples": "8",
    "grpo.max_steps": "2",
    "grpo.prompts_per_step": "2",
    "grpo.rollout.n_samples": "2",
    "grpo.rollout.max_new_tokens": "12",
    "grpo.mini_batch_size": "4",
    "grpo.micro_batch_size": "4",
    "grpo.eval_every": "0",
    "grpo.eval_prompts": "4",
    "grpo.eval_samples": "1",
    "grpo.checkpoint_every": "0",
    "eval.limit": "5",
    "eval.sampling.max_tokens": "16",
}
"""`--set` overrides that make the tiny-cpu pipeline run in a minute or two (the demo trains
longer): the local-run tests use them."""


def respond(reasoning: str | None, final: str | None) -> str:
    """A harmony completion: an analysis message (None: none), then a final one (None: none)."""
    text = "" if reasoning is None else f"<|channel|>analysis<|message|>{reasoning}<|end|>"
    if final is not None:
        text += f"<|start|>assistant<|channel|>final<|message|>{final}<|return|>"
    return text
