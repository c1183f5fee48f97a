"""Champion vs challenger on the same questions: per-question scores, the paired bootstrap,
and the sample size a stated power needs.

Both models answer the same ``Q`` questions with the same ``k`` samples and seeds in one eval
run. A question's score is the mean of the metric over its scored samples (each response
counts ``Outcome`` as the eval's summary does: ``eval_metrics.response_values``); questions
without a score for either model are left out. The test works on the per-question
differences ``d_q = candidate_q − champion_q``:

* observed difference ``D = mean(d)``, sample standard deviation ``s_d``;
* **paired bootstrap** (questions resampled with replacement, ``B`` times, fixed seed):
  ``D*_b = mean(d[i_b])``; the one-sided lower confidence bound at level ``c`` is the
  ``(1 − c)`` quantile of ``D*``; ``p = #{b : D*_b ≤ margin} / B``;
* **exact sign test** on the same differences, a guard for a difference carried by a handful
  of questions (where the percentile bootstrap is too eager: 3 wins and no loss out of 40
  give ``lower = 0.025``): with ``w`` questions won and ``l`` lost (ties dropped),
  ``p_sign = P(Binomial(w + l, ½) ≥ w) = Σ_{i≥w} C(w+l, i) / 2^(w+l)``;
* the candidate is better with confidence when ``lower > margin`` and ``p_sign ≤ 1 − c``.

Power (normal approximation of the paired mean): to detect a true difference ``δ > margin``
with power ``π`` at level ``c``, the questions needed are

    n = ⌈((z_c + z_π) · s_d / (δ − margin))²⌉

and with ``n`` questions the smallest such difference is ``margin + (z_c + z_π) · s_d / √n``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


def per_question_scores(results: Mapping, label: str, metric: str) -> dict[str, float]:
    """Question id → mean of ``metric`` over model ``label``'s scored samples of it."""
    totals: dict[str, list[float]] = {}
    for response in results["responses"]:
        if response.get("model") != label:
            continue
        value = (response.get("values") or {}).get(metric)
        if value is None or not math.isfinite(value):
            continue
        totals.setdefault(response["id"], []).append(float(value))
    return {qid: sum(values) / len(values) for qid, values in totals.items()}


def z(level: float) -> float:
    """The standard normal quantile ``z_level``."""
    return NormalDist().inv_cdf(level)


@dataclass(frozen=True)
class PairedComparison:
    """The paired bootstrap of one candidate against one reference.

    Attributes:
        questions: Questions scored for both.
        difference: ``D``, the mean per-question difference (candidate − reference).
        sd: ``s_d``, the standard deviation of the per-question differences.
        lower: The one-sided lower confidence bound of the difference at ``confidence``.
        p_value: Share of bootstrap means at or below ``margin``.
        confidence: The level ``c``.
        margin: The difference the lower bound must exceed.
        resamples: ``B``.
        wins: Questions where the candidate scored higher.
        losses: Questions where it scored lower.
    """

    questions: int
    difference: float
    sd: float
    lower: float
    p_value: float
    confidence: float
    margin: float
    resamples: int
    wins: int = 0
    losses: int = 0

    @property
    def sign_p(self) -> float:
        """The exact one-sided sign test's p-value: ``P(Binomial(w + l, ½) ≥ w)``."""
        n = self.wins + self.losses
        return sum(math.comb(n, i) for i in range(self.wins, n + 1)) / 2**n

    @property
    def better(self) -> bool:
        """The candidate is better with confidence: ``lower > margin`` and
        ``sign_p ≤ 1 − confidence``."""
        return self.lower > self.margin and self.sign_p <= 1.0 - self.confidence

    def questions_needed(self, effect: float, power: float) -> int | None:
        """Questions needed to detect a true difference ``effect`` with ``power`` at this
        level, for the observed ``s_d`` (``None`` when ``effect ≤ margin``)."""
        if effect <= self.margin:
            return None
        if self.sd == 0:
            return 2
        return math.ceil(((z(self.confidence) + z(power)) * self.sd / (effect - self.margin)) ** 2)

    def detectable(self, power: float) -> float:
        """The smallest true difference these questions detect with ``power``."""
        n = max(self.questions, 1)
        return self.margin + (z(self.confidence) + z(power)) * self.sd / math.sqrt(n)


def paired_bootstrap(
    differences: Sequence[float],
    confidence: float,
    margin: float = 0.0,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """The paired bootstrap of ``differences`` (see the module docstring).

    Raises:
        ValueError: no differences.
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        raise ValueError("no question was scored for both models")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    return PairedComparison(
        questions=int(d.size),
        difference=float(d.mean()),
        sd=float(d.std(ddof=1)) if d.size > 1 else 0.0,
        lower=float(np.quantile(means, 1.0 - confidence)),
        p_value=float(np.mean(means <= margin)),
        confidence=confidence,
        margin=margin,
        resamples=resamples,
        wins=int((d > 0).sum()),
        losses=int((d < 0).sum()),
    )


def compare(
    results: Mapping,
    candidate: str,
    reference: str,
    metric: str,
    confidence: float,
    margin: float = 0.0,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """The paired bootstrap of models ``candidate`` and ``reference`` of one eval's results.

    Raises:
        ValueError: no question was scored for both.
    """
    ours = per_question_scores(results, candidate, metric)
    theirs = per_question_scores(results, reference, metric)
    shared = sorted(set(ours) & set(theirs))
    differences = [ours[q] - theirs[q] for q in shared]
    return paired_bootstrap(differences, confidence, margin, resamples, seed)
