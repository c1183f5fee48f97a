"""The outcome of scored responses, one definition for the eval and GRPO's held-out eval.

``Outcome`` is what one scored response counts for: in its requested language or not (the
reasoning, the answer, both), brief, right, its reward and degeneracy. The eval's metrics
(``eval.eval_metrics``: rates with intervals, per language) and GRPO's held-out result
(``HeldOutResult``: the means the run logs, keeps in its state and picks the best policy by)
are both computed from it, so the language accuracies are defined once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from reward.degeneracy import Degeneracy, loop_words
from reward.scoring import ComplianceResult, Verdict

MISSING = "missing"
"""Detected language of a part that is absent (no analysis or no final channel)."""
LOOP = "loop"
"""Detected language of a part with the scorer's LOOP verdict: identified as a language, but a
repetition loop or not made of that language's words (scored as the wrong language)."""


def detected(verdict: Verdict, language: str | None) -> str:
    """A part's detected language as the metrics count it: ``loop`` for the LOOP verdict (the
    identifier placed it, the loop check did not), else the identified language or
    ``missing``."""
    return LOOP if verdict is Verdict.LOOP else language or MISSING


@dataclass(frozen=True)
class Outcome:
    """What the metrics need from one scored response.

    Attributes:
        language: The requested language (the eval: question, reasoning and answer; GRPO's
            held-out prompts: the reasoning's); None: the response had no labels.
        failed: The engine gave no response (error); left out of the metrics.
        reasoning_ok: The reasoning is in the requested language.
        answer_ok: The final answer is in the requested language.
        brief_ok: The final answer exists and is brief.
        reward: The compliance reward.
        correct: The numeric answer is right (``None``: not judged).
        reasoning_detected: Detected language of the reasoning (a code, ``other``, ``und``,
            ``missing`` or ``loop``).
        answer_detected: Same for the final answer.
        real_word_share: See ``reward.degeneracy`` (NaN: no words).
        repeated_ngram_rate: See ``reward.degeneracy`` (NaN: too short).
        reasoning_words: Words and numbers of the reasoning (``reward.degeneracy.loop_words``;
            0 when missing): what ``reasoning_length_ratio`` compares.
    """

    language: str | None
    failed: bool = False
    reasoning_ok: bool = False
    answer_ok: bool = False
    brief_ok: bool = False
    reward: float = math.nan
    correct: bool | None = None
    reasoning_detected: str = MISSING
    answer_detected: str = MISSING
    real_word_share: float = math.nan
    repeated_ngram_rate: float = math.nan
    reasoning_words: int = 0

    @property
    def loop(self) -> bool:
        """The reasoning or the answer got the LOOP verdict (a loop, a stopword salad or a copy
        of the question)."""
        return LOOP in (self.reasoning_detected, self.answer_detected)

    @property
    def both_ok(self) -> bool:
        """Reasoning and answer both in the requested language."""
        return self.reasoning_ok and self.answer_ok

    @classmethod
    def scored(
        cls, language: str | None, result: ComplianceResult, degeneracy: Degeneracy
    ) -> Outcome:
        """The outcome of a response the scorer judged (``result``) and whose text was
        measured (``degeneracy``): in the requested language means the MATCH verdict."""
        return cls(
            language=language,
            reasoning_ok=result.reasoning_language_ok,
            answer_ok=result.answer_language_ok,
            brief_ok=result.brief_ok,
            reward=result.reward,
            correct=result.correct,
            reasoning_detected=detected(result.reasoning_verdict, result.reasoning_language),
            answer_detected=detected(result.answer_verdict, result.answer_language),
            real_word_share=degeneracy.real_word_share,
            repeated_ngram_rate=degeneracy.repeated_ngram_rate,
            reasoning_words=len(loop_words(result.parsed.reasoning)),
        )


@dataclass(frozen=True)
class LanguageResult:
    """A held-out result of the prompts of one language."""

    mean_reward: float
    both_language_accuracy: float
    loop_rate: float = 0.0
    median_reasoning_words: float = 0.0


def median_reasoning_words(outcomes: Sequence[Outcome]) -> float:
    """The median of the responses' reasoning words (0.0 for none)."""
    return float(np.median([o.reasoning_words for o in outcomes])) if outcomes else 0.0


def reasoning_length_ratio(words: float, baseline_words: float) -> float:
    """``words / baseline_words``: a policy's median reasoning length against the SFT model's
    on the same questions (NaN when the baseline reasons in 0 words)."""
    return words / baseline_words if baseline_words > 0 else math.nan


@dataclass(frozen=True)
class HeldOutResult:
    """GRPO's held-out metrics of one policy: means over its responses (``from_outcomes``).

    Attributes:
        mean_reward: Mean reward.
        answer_language_accuracy: Share of answers in the requested language.
        reasoning_language_accuracy: Share of reasonings in the requested language.
        both_language_accuracy: Share with both.
        real_word_share: Mean real-word share of the responses that have words (0: none).
        repeated_ngram_rate: Mean repeated n-gram rate of those long enough (0: none).
        finished_fraction: Share of responses that ended with a stop token.
        loop_rate: Share of responses with a part that got the LOOP verdict.
        median_reasoning_words: Median reasoning length in words (``Outcome.reasoning_words``).
        per_language: Requested (reasoning) language → its result, languages sorted.
        step: The step of the policy evaluated (0: the SFT model); None when not placed.
    """

    mean_reward: float
    answer_language_accuracy: float
    reasoning_language_accuracy: float
    both_language_accuracy: float
    real_word_share: float
    repeated_ngram_rate: float
    finished_fraction: float
    per_language: dict[str, LanguageResult] = field(default_factory=dict)
    loop_rate: float = 0.0
    median_reasoning_words: float = 0.0
    step: int | None = None

    @classmethod
    def from_outcomes(cls, outcomes: Sequence[Outcome], finished: Sequence[bool]) -> HeldOutResult:
        """The means of ``outcomes`` (``finished``: whether each response stopped)."""
        shares = [o.real_word_share for o in outcomes if not math.isnan(o.real_word_share)]
        repeats = [o.repeated_ngram_rate for o in outcomes if not math.isnan(o.repeated_ngram_rate)]
        by_language: dict[str, list[Outcome]] = {}
        for outcome in outcomes:
            if outcome.language is not None:
                by_language.setdefault(outcome.language, []).append(outcome)
        return cls(
            mean_reward=_mean([o.reward for o in outcomes]),
            answer_language_accuracy=_mean([o.answer_ok for o in outcomes]),
            reasoning_language_accuracy=_mean([o.reasoning_ok for o in outcomes]),
            both_language_accuracy=_mean([o.both_ok for o in outcomes]),
            real_word_share=_mean(shares) if shares else 0.0,
            repeated_ngram_rate=_mean(repeats) if repeats else 0.0,
            finished_fraction=_mean(finished),
            per_language={
                language: LanguageResult(
                    _mean([o.reward for o in group]),
                    _mean([o.both_ok for o in group]),
                    _mean([o.loop for o in group]),
                    median_reasoning_words(group),
                )
                for language, group in sorted(by_language.items())
            },
            loop_rate=_mean([o.loop for o in outcomes]),
            median_reasoning_words=median_reasoning_words(outcomes),
        )

    def at_step(self, step: int) -> HeldOutResult:
        """This result placed at ``step``."""
        return HeldOutResult(**{**self.__dict__, "step": step})

    def metrics(self) -> dict[str, float]:
        """The flat metrics the run logs (``eval_<name>``): the means, then
        ``mean_reward_<language>``, ``both_language_accuracy_<language>``,
        ``loop_rate_<language>`` and ``median_reasoning_words_<language>`` per language."""
        out = {
            "mean_reward": self.mean_reward,
            "answer_language_accuracy": self.answer_language_accuracy,
            "reasoning_language_accuracy": self.reasoning_language_accuracy,
            "both_language_accuracy": self.both_language_accuracy,
            "real_word_share": self.real_word_share,
            "repeated_ngram_rate": self.repeated_ngram_rate,
            "finished_fraction": self.finished_fraction,
            "loop_rate": self.loop_rate,
            "median_reasoning_words": self.median_reasoning_words,
        }
        for language, result in self.per_language.items():
            out[f"mean_reward_{language}"] = result.mean_reward
            out[f"both_language_accuracy_{language}"] = result.both_language_accuracy
            out[f"loop_rate_{language}"] = result.loop_rate
            out[f"median_reasoning_words_{language}"] = result.median_reasoning_words
        return out

    def reasoning_length_ratios(self, baseline: HeldOutResult) -> dict[str, float]:
        """``reasoning_length_ratio`` overall and ``reasoning_length_ratio_<language>`` against
        ``baseline`` (the SFT model's held-out result, on the same prompts)."""
        out = {
            "reasoning_length_ratio": reasoning_length_ratio(
                self.median_reasoning_words, baseline.median_reasoning_words
            )
        }
        for language, result in self.per_language.items():
            base = baseline.per_language.get(language)
            out[f"reasoning_length_ratio_{language}"] = reasoning_length_ratio(
                result.median_reasoning_words, base.median_reasoning_words if base else 0.0
            )
        return out

    def to_json(self) -> dict[str, float]:
        """``metrics`` with the ``step`` first when placed: the form run states and summaries
        have always kept (``from_json`` reads it back)."""
        return ({} if self.step is None else {"step": self.step}) | self.metrics()

    @classmethod
    def from_json(cls, data: Mapping[str, float]) -> HeldOutResult:
        """A result from ``to_json``'s form, which run states written before this type also
        have (a checkpoint of an earlier version resumes)."""
        languages = sorted(
            key.removeprefix("both_language_accuracy_")
            for key in data
            if key.startswith("both_language_accuracy_")
        )
        return cls(
            mean_reward=data["mean_reward"],
            answer_language_accuracy=data["answer_language_accuracy"],
            reasoning_language_accuracy=data["reasoning_language_accuracy"],
            both_language_accuracy=data["both_language_accuracy"],
            real_word_share=data["real_word_share"],
            repeated_ngram_rate=data["repeated_ngram_rate"],
            finished_fraction=data["finished_fraction"],
            per_language={
                language: LanguageResult(
                    data[f"mean_reward_{language}"],
                    data[f"both_language_accuracy_{language}"],
                    data.get(f"loop_rate_{language}", 0.0),  # absent in states before #43
                    data.get(f"median_reasoning_words_{language}", 0.0),
                )
                for language in languages
            },
            step=data.get("step"),
            loop_rate=data.get("loop_rate", 0.0),
            median_reasoning_words=data.get("median_reasoning_words", 0.0),
        )


def _mean(values: Sequence[float | bool]) -> float:
    return float(np.mean(values))
