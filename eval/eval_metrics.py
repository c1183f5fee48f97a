"""Eval metrics over scored responses (``reward.outcome.Outcome``, which GRPO's held-out
result is computed from too): rates, means, 95% intervals, confusion matrices, deltas.

Intervals (95%):

* proportions (language accuracies, brevity, correctness, loops): **Wilson score interval**
  ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``z = 1.959964``;
* means (reward, real-word share, repeated n-gram rate): **Student t interval**
  ``mean ± t(0.975, n-1) · s / sqrt(n)`` (no interval for ``n < 2``).

Every response is counted as an independent observation; with ``n > 1`` samples per question
the samples of one question are correlated, so the intervals are then somewhat too narrow.
Responses whose generation failed (engine error) are left out of every metric and counted in
``failed``.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from core.languages import OTHER, SUPPORTED_LANGUAGES, UNDETERMINED
from reward.outcome import LOOP, MISSING, Outcome, median_reasoning_words, reasoning_length_ratio

Z_95 = 1.959963984540054
DETECTED_COLUMNS: tuple[str, ...] = (*SUPPORTED_LANGUAGES, OTHER, UNDETERMINED, MISSING, LOOP)

PROPORTIONS: tuple[str, ...] = (
    "reasoning_language_accuracy",
    "answer_language_accuracy",
    "both_language_accuracy",
    "brevity",
    "answer_correct",
    "loop_rate",
)
MEANS: tuple[str, ...] = (
    "mean_reward",
    "real_word_share",
    "repeated_ngram_rate",
    "median_reasoning_words",
)
METRICS: tuple[str, ...] = PROPORTIONS + MEANS
"""Every metric of a summary, in report order. All but ``loop_rate`` and
``repeated_ngram_rate`` are better when higher."""


@dataclass(frozen=True)
class Estimate:
    """A metric value with its 95% interval.

    Attributes:
        value: The rate or mean (NaN when ``n`` is 0).
        low: Lower bound of the interval (NaN when it cannot be computed).
        high: Upper bound.
        n: Observations behind it.
        method: ``"wilson"`` or ``"t"``.
    """

    value: float
    low: float
    high: float
    n: int
    method: str


def wilson_interval(successes: int, n: int, z: float = Z_95) -> Estimate:
    """The rate ``successes / n`` with its Wilson score interval.

    Raises:
        ValueError: ``successes`` is outside ``[0, n]``.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, "wilson")
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # the interval always holds p; clamping removes rounding error at p = 0 and p = 1
    low, high = min(max(0.0, center - half), p), max(min(1.0, center + half), p)
    return Estimate(p, low, high, n, "wilson")


def _t_cdf_upper_half(theta: float, df: int) -> float:
    """``P(0 < T < sqrt(df)·tan(theta))`` by Simpson's rule on the bounded integrand.

    With ``t = sqrt(df)·tan(θ)`` the t density becomes ``c·sqrt(df)·cos(θ)^(df-1) dθ``.
    """
    coefficient = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    steps = 2000
    h = theta / steps
    total = 1.0 + math.cos(theta) ** (df - 1)
    for i in range(1, steps):
        total += (4 if i % 2 else 2) * math.cos(i * h) ** (df - 1)
    return coefficient * total * h / 3


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0.5 < p < 1``).

    Raises:
        ValueError: ``p`` or ``df`` is out of range.
    """
    if not 0.5 < p < 1.0:
        raise ValueError(f"p must be in (0.5, 1), got {p}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    target = p - 0.5
    low, high = 0.0, math.pi / 2
    for _ in range(60):
        middle = (low + high) / 2
        if _t_cdf_upper_half(middle, df) < target:
            low = middle
        else:
            high = middle
    return math.sqrt(df) * math.tan((low + high) / 2)


def t_interval(values: Sequence[float]) -> Estimate:
    """The mean of ``values`` (NaNs dropped) with its Student t 95% interval."""
    data = [v for v in values if not math.isnan(v)]
    n = len(data)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, "t")
    mean = math.fsum(data) / n
    if n < 2:
        return Estimate(mean, math.nan, math.nan, n, "t")
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in data) / (n - 1))
    half = student_t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n, "t")


def _estimates(outcomes: Sequence[Outcome]) -> dict[str, Estimate]:
    n = len(outcomes)
    judged = [o for o in outcomes if o.correct is not None]
    return {
        "reasoning_language_accuracy": wilson_interval(sum(o.reasoning_ok for o in outcomes), n),
        "answer_language_accuracy": wilson_interval(sum(o.answer_ok for o in outcomes), n),
        "both_language_accuracy": wilson_interval(sum(o.both_ok for o in outcomes), n),
        "brevity": wilson_interval(sum(o.brief_ok for o in outcomes), n),
        "answer_correct": wilson_interval(sum(bool(o.correct) for o in judged), len(judged)),
        "loop_rate": wilson_interval(
            sum(LOOP in (o.reasoning_detected, o.answer_detected) for o in outcomes), n
        ),
        "mean_reward": t_interval([o.reward for o in outcomes]),
        "real_word_share": t_interval([o.real_word_share for o in outcomes]),
        "repeated_ngram_rate": t_interval([o.repeated_ngram_rate for o in outcomes]),
        "median_reasoning_words": Estimate(
            median_reasoning_words(outcomes) if n else math.nan, math.nan, math.nan, n, "median"
        ),
    }


def response_values(outcome: Outcome) -> dict[str, float | None]:
    """What one scored response counts for in each metric (``None``: not counted, as
    ``summarize`` leaves it out): 1.0/0.0 for the proportions, the value for the means.
    The gate's per-question scores are means of these (``eval.paired``)."""

    def number(value: float) -> float | None:
        return None if math.isnan(value) else float(value)

    return {
        "reasoning_language_accuracy": float(outcome.reasoning_ok),
        "answer_language_accuracy": float(outcome.answer_ok),
        "both_language_accuracy": float(outcome.both_ok),
        "brevity": float(outcome.brief_ok),
        "answer_correct": None if outcome.correct is None else float(outcome.correct),
        "loop_rate": float(LOOP in (outcome.reasoning_detected, outcome.answer_detected)),
        "mean_reward": number(outcome.reward),
        "real_word_share": number(outcome.real_word_share),
        "repeated_ngram_rate": number(outcome.repeated_ngram_rate),
    }


def confusion_matrix(
    pairs: Iterable[tuple[str, str]],
) -> dict[str, dict[str, int]]:
    """Counts of (requested, detected) pairs: rows are requested languages, columns detected.

    Every supported language is a row and every ``DETECTED_COLUMNS`` entry a column, zeros
    included, so that tables of different models line up.
    """
    counts = Counter(pairs)
    return {
        requested: {detected: counts[(requested, detected)] for detected in DETECTED_COLUMNS}
        for requested in SUPPORTED_LANGUAGES
    }


@dataclass(frozen=True)
class Summary:
    """Metrics of one model over the eval.

    Attributes:
        overall: Metric name → estimate, over all scored responses.
        per_language: Requested language → metric name → estimate.
        confusion: ``"reasoning"`` / ``"answer"`` → confusion matrix (requested → detected).
        responses: Responses generated (scored + failed).
        failed: Responses whose generation failed.
    """

    overall: dict[str, Estimate]
    per_language: dict[str, dict[str, Estimate]]
    confusion: dict[str, dict[str, dict[str, int]]]
    responses: int
    failed: int

    @property
    def failure_rate(self) -> float:
        """Share of responses whose generation failed."""
        return self.failed / self.responses if self.responses else 0.0

    def value(self, metric: str, language: str | None = None) -> float:
        """A metric's value overall or for one language.

        Raises:
            KeyError: Unknown metric or language.
        """
        table = self.overall if language is None else self.per_language[language]
        return table[metric].value

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        return asdict(self) | {"failure_rate": self.failure_rate}


def summarize(outcomes: Sequence[Outcome]) -> Summary:
    """Metrics overall, per requested language, and the confusion matrices."""
    scored = [o for o in outcomes if not o.failed]
    per_language = {
        code: _estimates([o for o in scored if o.language == code]) for code in SUPPORTED_LANGUAGES
    }
    return Summary(
        overall=_estimates(scored),
        per_language=per_language,
        confusion={
            "reasoning": confusion_matrix((o.language, o.reasoning_detected) for o in scored),
            "answer": confusion_matrix((o.language, o.answer_detected) for o in scored),
        },
        responses=len(outcomes),
        failed=len(outcomes) - len(scored),
    )


@dataclass(frozen=True)
class Delta:
    """Differences of one model's metric values from the baseline model's."""

    overall: dict[str, float] = field(default_factory=dict)
    per_language: dict[str, dict[str, float]] = field(default_factory=dict)


REASONING_LENGTH_REFERENCE = "sft"
"""The model whose median reasoning length ``reasoning_length_ratio`` divides by, when one has
this label (else the baseline)."""


def reasoning_length_ratios(
    summaries: Mapping[str, Summary], reference: str
) -> dict[str, dict[str, object]]:
    """``reasoning_length_ratio`` of each model: its median reasoning words ÷ ``reference``'s
    (the SFT model's), on the same questions, overall and per language (NaN where the
    reference's median is 0).

    Raises:
        KeyError: ``reference`` is not one of the summaries.
    """
    base = summaries[reference]
    metric = "median_reasoning_words"
    return {
        label: {
            "overall": reasoning_length_ratio(summary.value(metric), base.value(metric)),
            "per_language": {
                code: reasoning_length_ratio(summary.value(metric, code), base.value(metric, code))
                for code in SUPPORTED_LANGUAGES
            },
        }
        for label, summary in summaries.items()
    }


def deltas(summaries: Mapping[str, Summary], baseline: str) -> dict[str, Delta]:
    """``model − baseline`` for every metric, overall and per language, for each other model.

    Raises:
        KeyError: ``baseline`` is not one of the summaries.
    """
    base = summaries[baseline]
    out: dict[str, Delta] = {}
    for label, summary in summaries.items():
        if label == baseline:
            continue
        out[label] = Delta(
            overall={m: summary.value(m) - base.value(m) for m in METRICS},
            per_language={
                code: {m: summary.value(m, code) - base.value(m, code) for m in METRICS}
                for code in SUPPORTED_LANGUAGES
            },
        )
    return out
