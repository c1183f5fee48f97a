"""The reward's terms and their weights: what the scorer found about a response (``Verdict``,
``Judgement``) and how each registered term (``@reward_term``) prices it.

A new term is one function and one registration: its weights become ``RewardWeights`` fields
(settable by name from a config's ``reward_weights``), and the bounds, the scorer's components
and the reports follow. ``reward.scoring.ComplianceScorer`` judges a response and sums the
terms; the table of the defaults is in its module's docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    """Outcome of a language rule for one part of a response."""

    MATCH = "match"
    MISMATCH = "mismatch"
    UNDETERMINED = "undetermined"
    MISSING = "missing"
    NEUTRAL = "neutral"
    """A final answer with digits and no letters: no language to judge (the answer only)."""
    LOOP = "loop"
    """Identified as the requested language, but a repetition loop or not made of its words
    (``reward.degeneracy.LoopDetector``): scored as the wrong language."""


@dataclass(frozen=True)
class Judgement:
    """What the scorer found about one response, for the reward terms to price."""

    answer_verdict: Verdict
    reasoning_verdict: Verdict
    brief_ok: bool
    correct: bool | None
    """Whether the numeric answer equals the expected one; None when none was expected."""
    degenerate: bool = False
    """A part (reasoning or answer, in any language) is a loop, a stopword salad or a copy of
    the question."""


@dataclass(frozen=True)
class RewardTerm:
    """One part of the reward: its weights (name → the reference recipe's default) and how a
    judged response earns them (``price``). ``can_be_zero``: the term may add nothing (e.g.
    correctness without an expected answer), so 0 lies within its range."""

    weights: Mapping[str, float]
    price: Callable[[Judgement, RewardWeights], float]
    can_be_zero: bool = False

    def bounds(self, weights: RewardWeights) -> tuple[float, float]:
        values = [getattr(weights, name) for name in self.weights]
        values += [0.0] if self.can_be_zero else []
        return min(values), max(values)


REWARD_TERMS: dict[str, RewardTerm] = {}
"""The reward's terms, in the order they are summed and reported (``components``)."""


def reward_term(name: str, *, can_be_zero: bool = False, **weights: float):
    """Register the decorated ``price(judgement, weights) -> float`` as reward term ``name``
    with its weights and their defaults: a new term is this one function and this one
    registration (its weights become ``RewardWeights`` fields, settable by name from a config's
    ``reward_weights``; the bounds, the components and the reports follow).

    Raises:
        ValueError: the term or one of its weights is registered already.
    """

    def register(price: Callable[[Judgement, RewardWeights], float]):
        taken = {w for term in REWARD_TERMS.values() for w in term.weights}
        if name in REWARD_TERMS or taken & set(weights):
            raise ValueError(
                f"reward term {name!r} or its weights {sorted(taken & set(weights))} are "
                "registered already"
            )
        REWARD_TERMS[name] = RewardTerm(dict(weights), price, can_be_zero)
        return price

    return register


class RewardWeights:
    """Reward for each outcome of each registered term (``REWARD_TERMS``), by weight name;
    unset weights keep the reference recipe's defaults (their registration's).

    A missing, truncated, undetermined or looping part scores its rule's ``…_mismatch``
    weight: there is no weight of its own to set, so no setting can make saying less (or
    repeating words) pay.
    ``answer_language_neutral`` (a bare number) must lie between the answer's mismatch and
    match weights. Immutable and comparable, like the frozen dataclass it replaced.

    Raises:
        TypeError: an unknown weight name.
        ValueError: A weight is not a finite number, or the neutral weight is out of range.
    """

    __slots__ = ("_values",)

    def __init__(self, **overrides: float) -> None:
        defaults = {w: d for term in REWARD_TERMS.values() for w, d in term.weights.items()}
        unknown = sorted(set(overrides) - set(defaults))
        if unknown:
            raise TypeError(
                f"RewardWeights: unknown weight(s) {unknown}; known: {sorted(defaults)}"
            )
        values: dict[str, float] = {}
        for name, default in defaults.items():
            value = overrides.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"RewardWeights.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"RewardWeights.{name} must be finite, got {value!r}")
            values[name] = float(value)
        object.__setattr__(self, "_values", values)
        low, high = sorted((self.answer_language_mismatch, self.answer_language_match))
        if not low <= self.answer_language_neutral <= high:
            raise ValueError(
                f"RewardWeights.answer_language_neutral={self.answer_language_neutral} must lie "
                f"between answer_language_mismatch and answer_language_match ({low}..{high}): "
                "a bare number must not beat an answer in the right language"
            )

    def __getattr__(self, name: str) -> float:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"RewardWeights has no weight {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("RewardWeights is immutable: build a new one")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RewardWeights) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"RewardWeights({', '.join(f'{k}={v}' for k, v in self._values.items())})"

    def bounds(self) -> tuple[float, float]:
        """Smallest and largest reward any response can get."""
        ranges = [term.bounds(self) for term in REWARD_TERMS.values()]
        return sum(low for low, _ in ranges), sum(high for _, high in ranges)


@reward_term(
    "answer_language",
    answer_language_match=5.0,
    answer_language_mismatch=-5.0,
    answer_language_neutral=0.0,
)
def _answer_language(judged: Judgement, w: RewardWeights) -> float:
    return _verdict_reward(
        judged.answer_verdict,
        w.answer_language_match,
        w.answer_language_mismatch,
        w.answer_language_neutral,
    )


@reward_term("reasoning_language", reasoning_language_match=1.5, reasoning_language_mismatch=-1.5)
def _reasoning_language(judged: Judgement, w: RewardWeights) -> float:
    return _verdict_reward(
        judged.reasoning_verdict, w.reasoning_language_match, w.reasoning_language_mismatch
    )


@reward_term("brevity", brief_answer=0.5, long_answer=-1.0)
def _brevity(judged: Judgement, w: RewardWeights) -> float:
    return w.brief_answer if judged.brief_ok else w.long_answer


@reward_term("degeneracy", clean_text=0.0, degenerate_text=-2.0)
def _degeneracy(judged: Judgement, w: RewardWeights) -> float:
    """A loop, a stopword salad or a copy of the question anywhere costs more than the part
    could gain: the part already scores as the wrong language, and this comes on top."""
    return w.degenerate_text if judged.degenerate else w.clean_text


@reward_term("correctness", can_be_zero=True, correct_answer=0.0, wrong_answer=0.0)
def _correctness(judged: Judgement, w: RewardWeights) -> float:
    if judged.correct is None:  # no expected answer: nothing to judge
        return 0.0
    return w.correct_answer if judged.correct else w.wrong_answer


def _verdict_reward(
    verdict: Verdict, match: float, mismatch: float, neutral: float | None = None
) -> float:
    """A language rule's reward: MISMATCH, MISSING, UNDETERMINED and LOOP all score
    ``mismatch``."""
    if verdict is Verdict.MATCH:
        return match
    if verdict is Verdict.NEUTRAL and neutral is not None:
        return neutral
    return mismatch
