"""Fixtures for trainer tests: a tiny GPT-OSS model and data-prep outputs, built once."""

from __future__ import annotations

import pytest

from trainer.tiny_model import SMALLEST, build_tiny_model

SMALL = SMALLEST


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small tiny-GPT-OSS directory (smaller than the demo's, for fast tests)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", SMALL)
