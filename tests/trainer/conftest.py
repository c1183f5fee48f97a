"""Fixtures for trainer tests: a tiny GPT-OSS model and data-prep outputs, built once."""

from __future__ import annotations

import pytest

from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare_dataset
from trainer.tiny_model import SMALLEST, build_tiny_model

SMALL = SMALLEST


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory):
    """train.jsonl / eval.jsonl from the bundled sample."""
    out = tmp_path_factory.mktemp("data")
    prepare_dataset(
        DataPrepConfig(workers=1), out / "train.jsonl", out / "eval.jsonl", out / "quarantine.jsonl"
    )
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small tiny-GPT-OSS directory (smaller than the demo's, for fast tests)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", SMALL)
