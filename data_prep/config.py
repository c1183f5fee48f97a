"""The typed configuration of the data-prep step: one source of every default."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from core.config_model import ConfigModel

BUNDLED_SOURCE = "bundled"
HUB_DATASET_ID = "HuggingFaceH4/Multilingual-Thinking"
BUNDLED_AUGMENT_FACTOR = 9
"""Synthetic recombinations per train row of the bundled sample (``augment_factor: auto``):
its ~300 train rows are too few for a model trained from scratch to learn languages rather
than rows; 9 per row give ~3,000 examples (data_prep/augment.py, docs/benchmarks.md)."""

AnswerLanguagePolicy = Literal["user", "same-as-reasoning"]


class QuestionSetConfig(ConfigModel):
    """A set of questions written in the user's language, mixed into GRPO's prompts.

    Each row becomes a prompt-only record (no reference answer, so SFT does not see it)
    labelled (L, L): reason and answer in the question's language L, the deployed task. It
    goes to the train split only; GRPO draws prompts in proportion to ``weight``.

    Attributes:
        source: A hub dataset id, a local directory / ``.jsonl`` / ``.json`` / ``.parquet``
            path, or an ``s3://`` URI (read as ``DataPrepConfig.source`` is).
        question_column: The column holding the question text.
        language_column: A column holding the question's language (a code such as ``fr`` or
            a name such as ``French``); ``None``: detected from the question.
        split: Split to load when ``source`` is a hub dataset id.
        weight: GRPO samples each prompt of this set with this weight (the main dataset's
            prompts have weight 1): 2.0 makes one of its prompts twice as likely to be drawn.
        max_rows: Read at most this many rows (``None``: all).
        persona: The persona line of the prompts' developer instructions.
        max_bad_fraction: The step fails when more than this share of the set's rows is
            quarantined (repeated questions aside), or when the set gives no question at all.
    """

    source: str
    question_column: str = "question"
    language_column: str | None = None
    split: str = "train"
    weight: float = Field(1.0, gt=0.0)
    max_rows: int | None = Field(None, ge=1)
    persona: str = "You are a helpful assistant."
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)


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
            the same language (see data_prep/augment.py); for tiny-model demos. 0: none;
            ``"auto"``: ``BUNDLED_AUGMENT_FACTOR`` for the bundled sample, none for any other
            source (what the ``tiny-cpu`` preset sets, so a pipeline compiled from it adds
            no synthetic row to a user's ``source`` unless a number is asked for).
        workers: processes that validate and render rows when the source has more than
            ~1,000 rows; 0 means one per CPU core (at most 8). The output does not depend on it.
        question_sets: multilingual question sets mixed into GRPO's prompts (prompt-only
            rows in the train split; see QuestionSetConfig and docs/data_prep.md).
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
    augment_factor: Annotated[int, Field(ge=0)] | Literal["auto"] = 0
    workers: int = Field(0, ge=0)
    question_sets: list[QuestionSetConfig] = Field(default_factory=list)

    @property
    def synthetic_per_row(self) -> int:
        """The augment factor this source gets (``"auto"`` resolved from ``source``)."""
        if self.augment_factor != "auto":
            return self.augment_factor
        return BUNDLED_AUGMENT_FACTOR if self.source == BUNDLED_SOURCE else 0
