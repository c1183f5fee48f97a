"""Fixtures for the megatron-bridge tests: the Python 3.12 env check and tiny GPT-OSS models.

These tests need megatron-core 0.19 / megatron-bridge 0.6 (Python >= 3.12), which the main
3.11 environment cannot hold: there they are skipped, saying so. Run them with
``bash tools/run_megatron_tests.sh`` (builds ``.venv-megatron`` with tools/megatron_env.sh).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from trainer.tiny_model import TinyModelConfig, build_tiny_model

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    # cpu_patches and convert_worker are imported by name (a `megatron.` prefix would
    # collide with the real megatron namespace package). Appended, not prepended: other
    # tests do `from conftest import …` and must get tests/conftest.py, not this file.
    sys.path.append(str(HERE))

RUN_HINT = "run: bash tools/run_megatron_tests.sh"

# A small fixed corpus, so the tokenizer needs nothing from data_prep's sources. It has more
# than enough merges for vocab_size=320, so the vocabulary is exactly 320, even, as
# tensor parallelism needs (megatron-bridge does not pad the vocabulary).
CORPUS = [
    "Let me think about what the user needs and answer briefly and clearly.",
    "Here is a short answer about minutes, hours and the days of the week.",
    "Je réfléchis à ce que demande l'utilisateur et je réponds brièvement.",
    "Voici une réponse courte sur les minutes, les heures et les jours.",
    "Ich überlege, was der Nutzer braucht, und antworte kurz und klar.",
    "Hier ist eine kurze Antwort über Minuten, Stunden und Wochentage.",
    "Pienso en lo que necesita el usuario y respondo de forma breve.",
    "Aquí está una respuesta corta sobre minutos, horas y días.",
    "Penso a ciò che chiede l'utente e rispondo in modo breve e chiaro.",
    "Ecco una risposta breve su minuti, ore e giorni della settimana.",
] * 10

TINY_MODELS = {
    # tests/trainer's SMALL shape: hidden == intermediate, the square expert case that
    # megatron-bridge's GPT-OSS down_proj orientation check special-cases.
    "square": TinyModelConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    ),
    # The demo model's shape (TinyModelConfig defaults): 4 heads / 2 KV, intermediate 256.
    "default": TinyModelConfig(vocab_size=320),
}


def megatron_unavailable_reason() -> str | None:
    """Why megatron.bridge cannot be used here, or ``None`` when it can."""
    if sys.version_info < (3, 12):
        version = ".".join(map(str, sys.version_info[:3]))
        return (
            f"megatron-core 0.19 / megatron-bridge 0.6 need Python >= 3.12, this is {version}; "
            f"{RUN_HINT}"
        )
    try:
        spec = importlib.util.find_spec("megatron.bridge")
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return f"megatron-bridge is not installed in {sys.prefix}; {RUN_HINT}"
    from cpu_patches import import_megatron_bridge

    try:
        import_megatron_bridge()
    except ImportError as err:
        return f"megatron.bridge does not import: {err}"
    return None


@pytest.fixture(scope="session")
def megatron_bridge():
    """``megatron.bridge``, imported (with the CPU import shim where TE is missing), or skip."""
    reason = megatron_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import megatron.bridge

    return megatron.bridge


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """name → HF directory of a tiny GPT-OSS model (fp32), built on first use."""
    built: dict = {}

    class Models(dict):
        def __missing__(self, name):
            out = tmp_path_factory.mktemp(f"tiny-{name}") / "model"
            built[name] = build_tiny_model(out, TINY_MODELS[name], corpus=CORPUS)
            return built[name]

    return Models()
