"""The typed configuration of the data-prep step: one source of every default."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from eval.config_model import ConfigModel

BUNDLED_SOURCE = "bundled"
HUB_DATASET_ID = "HuggingFaceH4/Multilingual-Thinking"

AnswerLanguagePolicy = Literal["user", "same-as-reasoning"]


class DataPrepConfig(ConfigModel):
    """How raw Multilingual-Thinking rows become train/eval JSONL.

    Attributes:
        source: ``"bundled"`` (the sample shipped in ``data_prep/sample``), a hub dataset id
            such as ``HuggingFaceH4/Multilingual-Thinking``, a local directory / ``.jsonl`` /
            ``.json`` / ``.parquet`` path, or an ``s3://bucket/key-or-prefix`` URI.
        hub_split: split to load when ``source`` is a hub dataset id.
        eval_fraction: share of each reasoning language's rows that goes to the eval split.
        seed: seeds the split; the same seed and rows always give the same split.
        max_bad_fraction: the step fails when more than this share of rows is quarantined.
        answer_language_policy: ``user``: answer in the language the user wrote in (detected);
            ``same-as-reasoning``: answer in the reasoning language, as the 50-question eval asks.
        max_field_chars: a field longer than this is quarantined as oversize.
        reasoning_effort: the harmony system message's ``Reasoning:`` level.
        augment_factor: synthetic train examples per train row, recombined from sentences in
            the same language (see data_prep/augment.py); for tiny-model demos. 0: none.
        workers: processes that validate and render rows when the source has more than
            ~1,000 rows; 0 means one per CPU core (at most 8). The output does not depend on it.
    """

    model_config = ConfigDict(extra="forbid")

    source: str = BUNDLED_SOURCE
    hub_split: str = "train"
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    seed: int = 42
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)
    answer_language_policy: AnswerLanguagePolicy = "user"
    max_field_chars: int = Field(32_000, gt=0)
    reasoning_effort: Literal["low", "medium", "high"] = "medium"
    augment_factor: int = Field(0, ge=0)
    workers: int = Field(0, ge=0)
