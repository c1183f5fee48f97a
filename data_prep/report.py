"""What the data-prep step did (``DataPrepReport``): counts by outcome, language and reason,
and the lengths of the rows kept; read by the dataset card and the step's metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from core.languages import SUPPORTED_LANGUAGES
from data_prep.fingerprint import DataFingerprint
from data_prep.lengths import LengthHistogram


@dataclass
class DataPrepReport:
    """What the step did: counts by outcome, language and reason, plus length statistics."""

    source: str
    fingerprint: DataFingerprint | None = None
    """What was read, pinned (``data_prep.fingerprint``): the card and the step's outputs."""
    rows_read: int = 0
    rows_valid: int = 0
    rows_bad: int = 0
    rows_duplicate: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    synthetic_rows: int = 0
    prompt_only_rows: int = 0
    """Train rows from ``question_sets``: prompts for GRPO, no reference answer."""
    prompt_only_by_language: Counter = field(default_factory=Counter)
    question_rows_bad: int = 0
    reasons: Counter = field(default_factory=Counter)
    first_bad: list[str] = field(default_factory=list)
    train_by_language: Counter = field(default_factory=Counter)
    eval_by_language: Counter = field(default_factory=Counter)
    answer_languages: Counter = field(default_factory=Counter)
    answer_sources: Counter = field(default_factory=Counter)
    lengths: dict[str, dict[str, LengthHistogram]] = field(default_factory=dict)
    """Per reasoning language and field (user, analysis, final): lengths of the rows kept."""

    @property
    def quarantined(self) -> int:
        """Rows in the quarantine file: bad, duplicate, and question-set rows."""
        return self.rows_bad + self.rows_duplicate + self.question_rows_bad

    @property
    def bad_fraction(self) -> float:
        return self.rows_bad / self.rows_read if self.rows_read else 0.0

    def metrics(self) -> dict[str, float]:
        """Flat scalar metrics (for KFP ``Metrics`` and MLflow)."""
        out: dict[str, float] = {
            "rows_read": self.rows_read,
            "rows_valid": self.rows_valid,
            "rows_quarantined": self.quarantined,
            "rows_bad": self.rows_bad,
            "rows_duplicate": self.rows_duplicate,
            "bad_fraction": round(self.bad_fraction, 6),
            "train_rows": self.train_rows,
            "eval_rows": self.eval_rows,
            "synthetic_train_rows": self.synthetic_rows,
            "prompt_only_train_rows": self.prompt_only_rows,
            "question_rows_quarantined": self.question_rows_bad,
        }
        for lang in SUPPORTED_LANGUAGES:
            out[f"train_rows_{lang}"] = self.train_by_language[lang]
            out[f"eval_rows_{lang}"] = self.eval_by_language[lang]
        return out
