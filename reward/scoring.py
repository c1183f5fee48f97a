"""Language-compliance reward: did the model reason and answer in the requested languages?

The one definition used as the GRPO reward (``trainer/`` imports it) and by the eval.

Per response, against its labels (reasoning language, answer language):

=====================  ==========================================  ==========  ==========
component              rule                                        pass        fail
=====================  ==========================================  ==========  ==========
answer language        share of the final answer in the answer     +5.0        -5.0
                       language >= ``min_language_fraction`` (0.65)
reasoning language     same for the analysis channel               +1.5        -1.5
brief answer           final answer has <= 2 sentences             +0.5        -1.0
correct answer         numeric answer equals the expected one      0.0         0.0
                       (reported; not rewarded by default)
=====================  ==========================================  ==========  ==========

No refuge: saying less never pays.
    * a part that is **missing** (no final channel, e.g. cut off by the token limit; no or
      empty analysis channel), **truncated** (reasoning cut off before the final channel; a
      final answer cut off by the token limit, i.e. with no end token, when the response is
      read with its special tokens, as GRPO's rollouts and the eval read it) or
      **undetermined** (present, but too little text to tell its language, e.g. ``"R."`` or
      ``"Oui."`` when the identifier abstains) fails its language rule exactly as the wrong
      language does; a missing final answer also fails the brevity rule;
    * the one exception is a **language-neutral** final answer: digits and no letter at all
      (``"42"``, ``"12,5 %"``), which scores ``answer_language_neutral`` (0.0): worse than an
      answer in the right language, better than one in the wrong language;
    * correctness is only judged when an expected answer is given; otherwise it adds 0.

No loop passes: a part the identifier places in the requested language but that is a
repetition loop, or whose words the language's word list does not know
(``reward.degeneracy.LoopDetector``: repeated word pairs, few distinct words, one dominant
word, unknown words), gets the **loop** verdict, scored as the wrong language. The identifier
reads character n-grams, so a loop of words two languages share (``"La con una con una con
con una ..."``, scored Italian) passed it, and the demo's GRPO policy learned such loops when
asked in Italian (+7.0 each).

So for a response whose parts are in the requested languages, shortening a part until its
language can no longer be told, or dropping it, never raises the reward
(``tests/reward/test_scoring.py`` checks it on every prefix of a response).

Bounds: the reward always lies in ``RewardWeights.bounds()`` — with the defaults
[-9.5, +7.0] (-7.5 without a degenerate part). A response whose labels cannot be read
(unknown language code) gets the neutral reward 0.0 (clamped into the bounds) and ``error``
set; GRPO reads every prompt's labels
when it loads them (``trainer.grpo.prompts.load_prompts``), so that this never happens
mid-training.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import filterfalse

from core.language_id import LanguageIdentifier, LanguageProfile, default_identifier
from core.languages import LanguageLabels, UnknownLanguageError
from core.parsing import ParsedResponse, parse_response
from core.sentences import count_sentences
from reward.degeneracy import (
    LoopDetector,
    LoopSignal,
    WindowExtremes,
    function_words,
    known_word_share,
    loop_words,
)
from reward.labels import LabelsLike, parse_labels
from reward.numbers import extract_numeric_answer, numbers_match
from reward.terms import REWARD_TERMS, Judgement, RewardWeights, Verdict

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS_FOR_SENTENCES = 20_000
"""A final answer longer than this is not brief, whatever its sentences."""

MIN_LANGUAGE_FRACTION = 0.65
"""Share of a part (by letters, over the judged sentences) that must be in the requested
language: a quote or a term in another language passes, a half-and-half text does not."""

REASONING_MIN_WORDS = 5
"""A reasoning with fewer words (numbers count) is undetermined: too little evidence that the
model reasoned in a language. The bundled training rows' reasonings: 98.5 % have more."""

REASONING_MIN_REAL_WORDS = 3
"""… or with fewer words that the reasoning language's word list knows."""

_USER_MESSAGE = re.compile(r"<\|start\|>user<\|message\|>(.*?)(?:<\|end\|>|$)", re.DOTALL)

_CONTENT = re.compile(r"[^\W_]")  # a letter or digit: a part without one is missing

_PartProfiles = tuple[LanguageProfile | None, LanguageProfile | None]
"""Profiles of a response's final answer and reasoning; ``None`` for a missing part."""


@dataclass(frozen=True)
class _Words:
    """A response's ``loop_words`` (final answer, reasoning) and their worst stretches
    (``LoopDetector.stretches``; ``None``: not measured)."""

    answer: list[str]
    reasoning: list[str]
    answer_worst: WindowExtremes | None = None
    reasoning_worst: WindowExtremes | None = None


def _is_present(text: str | None) -> bool:
    """A part is present when it has a letter or a digit."""
    return text is not None and _CONTENT.search(text) is not None


@dataclass(frozen=True, slots=True)
class ComplianceResult:
    """Everything the scorer found about one response.

    Attributes:
        reward: The total reward, within ``RewardWeights.bounds()``.
        components: The reward's parts, one per registered term (``REWARD_TERMS``):
            ``answer_language``, ``reasoning_language``, ``brevity``, ``correctness``.
        parsed: The response split into reasoning and final answer.
        labels: The labels judged against; ``None`` when they could not be read.
        answer_verdict: Outcome of the answer-language rule.
        reasoning_verdict: Outcome of the reasoning-language rule.
        answer_language: Dominant language of the final answer (code, "other", "und"), or
            ``None`` when there is no final answer.
        reasoning_language: Same for the reasoning.
        answer_fraction: Share of the final answer in the requested answer language.
        reasoning_fraction: Share of the reasoning in the requested reasoning language.
        answer_sentences: Sentences in the final answer (0 when missing).
        brief_ok: The final answer exists and has at most ``max_answer_sentences`` sentences.
        predicted_answer: The number read from the final answer, if any.
        correct: Whether it equals the expected answer; ``None`` when none was expected.
        answer_loop: Why the final answer got the LOOP verdict (a ``LoopSignal``), else
            ``None``.
        reasoning_loop: Same for the reasoning.
        error: Why the response could not be scored (unreadable labels, or an internal error,
            which is also logged), else ``None``. Such a response gets the neutral reward.
    """

    reward: float
    components: Mapping[str, float]
    parsed: ParsedResponse
    labels: LanguageLabels | None
    answer_verdict: Verdict
    reasoning_verdict: Verdict
    answer_language: str | None = None
    reasoning_language: str | None = None
    answer_fraction: float = 0.0
    reasoning_fraction: float = 0.0
    answer_sentences: int = 0
    brief_ok: bool = False
    predicted_answer: float | None = None
    correct: bool | None = None
    answer_loop: LoopSignal | None = None
    reasoning_loop: LoopSignal | None = None
    error: str | None = None

    @property
    def answer_language_ok(self) -> bool:
        """The final answer is in the requested language."""
        return self.answer_verdict is Verdict.MATCH

    @property
    def reasoning_language_ok(self) -> bool:
        """The reasoning is in the requested language."""
        return self.reasoning_verdict is Verdict.MATCH

    def metrics(self) -> dict[str, float]:
        """Flat numeric metrics for logging (booleans as 0/1, missing values as NaN)."""
        return {
            "reward": self.reward,
            "answer_language_ok": float(self.answer_language_ok),
            "reasoning_language_ok": float(self.reasoning_language_ok),
            "answer_undetermined": float(self.answer_verdict is Verdict.UNDETERMINED),
            "answer_neutral": float(self.answer_verdict is Verdict.NEUTRAL),
            "reasoning_undetermined": float(self.reasoning_verdict is Verdict.UNDETERMINED),
            "answer_missing": float(self.answer_verdict is Verdict.MISSING),
            "answer_loop": float(self.answer_verdict is Verdict.LOOP),
            "reasoning_loop": float(self.reasoning_verdict is Verdict.LOOP),
            "brief_ok": float(self.brief_ok),
            "truncated": float(self.parsed.truncated),
            "answer_fraction": self.answer_fraction,
            "reasoning_fraction": self.reasoning_fraction,
            "correct": math.nan if self.correct is None else float(self.correct),
            "scoring_error": float(self.error is not None),
        }


@dataclass
class ComplianceScorer:
    """Scores responses for language compliance (see the module docstring for the rules).

    Args:
        weights: Reward per rule outcome.
        max_answer_sentences: The brevity rule's limit.
        min_language_fraction: Share of a part that must be in the requested language.
        identifier: Language identifier; default: the process-wide one (loaded once).
        loop_detector: Tells loops from text (``reward.degeneracy``); ``None`` turns the
            LOOP verdict off (for comparisons: a loop then scores as its identified language).

    Raises:
        ValueError: A setting is out of range.
    """

    weights: RewardWeights = field(default_factory=RewardWeights)
    max_answer_sentences: int = 2
    min_language_fraction: float = MIN_LANGUAGE_FRACTION
    identifier: LanguageIdentifier | None = None
    loop_detector: LoopDetector | None = field(default_factory=LoopDetector)

    def __post_init__(self) -> None:
        limit = self.max_answer_sentences
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_answer_sentences must be an int >= 1, got {limit!r}")
        if not 0.5 < self.min_language_fraction <= 1.0:
            raise ValueError(
                f"min_language_fraction must be in (0.5, 1], got {self.min_language_fraction}"
            )
        if self.identifier is None:
            self.identifier = default_identifier()
        self._bounds = self.weights.bounds()

    @property
    def bounds(self) -> tuple[float, float]:
        """Smallest and largest reward this scorer can give."""
        return self._bounds

    def score(
        self,
        response: str | ParsedResponse | None,
        labels: LabelsLike,
        expected_answer: float | str | None = None,
        prompt: str | None = None,
    ) -> ComplianceResult:
        """Score one response. Never raises.

        Args:
            response: The generated text (any harmony form or plain), or an already split
                ``ParsedResponse`` (e.g. from an engine that returns reasoning separately).
            labels: ``LanguageLabels`` or a label string ``"fr"`` / ``"fr/en"``.
            expected_answer: The expected numeric answer, if the problem has one (a number,
                or a string such as ``"42"`` or ``"1,5"``); non-numeric values are ignored.
            prompt: The question (or the whole prompt: its last user message is taken); a
                reasoning or answer that copies it is degenerate. None: not checked.
        """
        parsed = response if isinstance(response, ParsedResponse) else parse_response(response)
        return self._score_one(parsed, labels, expected_answer, None, prompt)

    def score_batch(
        self,
        responses: Sequence[str | ParsedResponse | None],
        labels: LabelsLike | Sequence[LabelsLike],
        expected_answers: Sequence[float | str | None] | None = None,
        prompts: Sequence[str | None] | None = None,
    ) -> list[ComplianceResult]:
        """Score a batch (e.g. one GRPO rollout batch). Never raises on bad items.

        Args:
            responses: The responses.
            labels: One label for all responses, or one per response.
            expected_answers: One expected numeric answer (or ``None``) per response.
            prompts: One question or prompt (or ``None``) per response (``score``).

        Raises:
            ValueError: ``labels``, ``expected_answers`` or ``prompts`` is a sequence whose
                length differs from ``responses`` (a caller bug, caught on the first batch).
        """
        n = len(responses)
        if isinstance(labels, str | LanguageLabels | Mapping):
            label_list: Sequence[object] = [labels] * n
        else:
            label_list = labels
            if len(label_list) != n:
                raise ValueError(f"got {n} responses but {len(label_list)} labels")
        if expected_answers is None:
            expected: Sequence[float | str | None] = [None] * n
        else:
            expected = expected_answers
            if len(expected) != n:
                raise ValueError(f"got {n} responses but {len(expected)} expected answers")
        if prompts is None:
            asked: Sequence[str | None] = [None] * n
        else:
            asked = prompts
            if len(asked) != n:
                raise ValueError(f"got {n} responses but {len(asked)} prompts")
        parsed = [r if isinstance(r, ParsedResponse) else parse_response(r) for r in responses]
        try:
            profiles = self._profiles(parsed)
            words = self._words(parsed)
        except Exception:  # noqa: BLE001 - score one by one, so only the bad item is unscored
            logger.exception("batch language identification failed; scoring one by one")
            items = zip(parsed, label_list, expected, asked, strict=True)
            return [self.score(p, lab, e, q) for p, lab, e, q in items]  # type: ignore[arg-type]
        items = zip(parsed, label_list, expected, profiles, asked, words, strict=True)
        return [
            self._score_one(p, lab, e, profile, q, w)  # type: ignore[arg-type]
            for p, lab, e, profile, q, w in items
        ]

    # -- internals -------------------------------------------------------------------------

    def _profiles(self, batch: Sequence[ParsedResponse]) -> list[_PartProfiles]:
        """Language profiles of the final answer and the reasoning of each response (``None``
        for a missing part), all identified in one pass."""
        assert self.identifier is not None
        texts = [
            text
            for parsed in batch
            for text in (parsed.final, parsed.reasoning)
            if _is_present(text)
        ]
        found = iter(self.identifier.profiles(texts))
        return [
            (
                next(found) if _is_present(parsed.final) else None,
                next(found) if _is_present(parsed.reasoning) else None,
            )
            for parsed in batch
        ]

    def _words(self, batch: Sequence[ParsedResponse]) -> list[_Words]:
        """Each response's loop words, and (with a loop detector) their worst stretches, all
        measured in one pass."""
        words = [(loop_words(parsed.final), loop_words(parsed.reasoning)) for parsed in batch]
        if self.loop_detector is None:
            return [_Words(answer, reasoning) for answer, reasoning in words]
        worst = iter(self.loop_detector.stretches([part for pair in words for part in pair]))
        return [_Words(answer, reasoning, next(worst), next(worst)) for answer, reasoning in words]

    def _score_one(
        self,
        parsed: ParsedResponse,
        labels: LabelsLike,
        expected_answer: object,
        profiles: _PartProfiles | None,
        prompt: str | None = None,
        words: _Words | None = None,
    ) -> ComplianceResult:
        """``score`` for a parsed response, with its parts' profiles and words if already
        computed."""
        try:
            parsed_labels = parse_labels(labels)
        except UnknownLanguageError as err:
            return self._unscored(parsed, str(err))
        try:
            if profiles is None:
                profiles = self._profiles([parsed])[0]
            if words is None:
                words = self._words([parsed])[0]
            return self._score(parsed, parsed_labels, expected_answer, profiles, words, prompt)
        except Exception as err:  # noqa: BLE001 - the batch API must not stop training
            logger.exception("scoring failed; giving the neutral reward")
            return self._unscored(parsed, f"internal error: {type(err).__name__}: {err}")

    def _unscored(self, parsed: ParsedResponse, message: str) -> ComplianceResult:
        low, high = self._bounds
        reward = min(max(0.0, low), high)
        components = dict.fromkeys(REWARD_TERMS, 0.0)
        return ComplianceResult(
            reward=reward,
            components=components,
            parsed=parsed,
            labels=None,
            answer_verdict=Verdict.UNDETERMINED,
            reasoning_verdict=Verdict.UNDETERMINED,
            error=message,
        )

    def _loop(
        self,
        words: Sequence[str],
        worst: WindowExtremes | None,
        verdict: Verdict,
        language: str,
        asked: Sequence[str],
    ) -> tuple[Verdict, LoopSignal | None]:
        """A part's verdict after the loop check, and the signal found. A part in the
        requested language is checked on every signal, one in another language (or whose
        language is undetermined) on those that need no language (repetition, copying): a loop
        costs the same in any language."""
        assert self.loop_detector is not None
        if verdict in (Verdict.MISSING, Verdict.NEUTRAL) or not words:
            return verdict, None
        checked = language if verdict is Verdict.MATCH else None
        signal = self.loop_detector.signal(None, checked, asked, tokens=words, worst=worst)
        return (Verdict.LOOP, signal) if signal else (verdict, None)

    def _judge(
        self, profile: LanguageProfile | None, target: str, text: str | None = None
    ) -> tuple[Verdict, str | None, float]:
        if profile is None:
            return Verdict.MISSING, None, 0.0
        if not profile.determined:
            if text is not None and _is_language_neutral(text):
                return Verdict.NEUTRAL, profile.dominant, 0.0
            return Verdict.UNDETERMINED, profile.dominant, 0.0
        share = profile.fraction(target)
        verdict = Verdict.MATCH if share >= self.min_language_fraction else Verdict.MISMATCH
        return verdict, profile.dominant, share

    def _score(
        self,
        parsed: ParsedResponse,
        labels: LanguageLabels,
        expected_answer: object,
        profiles: _PartProfiles,
        words: _Words,
        prompt: str | None = None,
    ) -> ComplianceResult:
        w = self.weights
        answer_profile, reasoning_profile = profiles
        answer_verdict, answer_language, answer_fraction = self._judge(
            answer_profile, labels.answer, parsed.final
        )
        reasoning_verdict, reasoning_language, reasoning_fraction = self._judge(
            reasoning_profile, labels.reasoning
        )
        if parsed.final is None and parsed.truncated:
            reasoning_verdict = Verdict.MISSING  # cut off before the answer: not reasoning done
        if parsed.final is not None and parsed.truncated:
            # the answer was cut off by the token limit (no end token): not an answer given.
            # Scored on its text, a policy gains by never stopping: a longer answer is easier
            # to identify (seen in the demo: GRPO stopped ending its answers, 77% -> 23%)
            answer_verdict = Verdict.MISSING
        answer_words, reasoning_words = words.answer, words.reasoning
        if reasoning_verdict is Verdict.MATCH and not _enough_reasoning(
            reasoning_words, labels.reasoning
        ):
            reasoning_verdict = Verdict.UNDETERMINED  # too few words to be reasoning
        if answer_verdict is Verdict.MATCH and not _has_content(answer_words, labels.answer):
            answer_verdict = Verdict.UNDETERMINED  # function words only: "et par."
        answer_loop = reasoning_loop = None
        if self.loop_detector is not None:
            asked = loop_words(_question(prompt)) if prompt else ()
            answer_verdict, answer_loop = self._loop(
                answer_words, words.answer_worst, answer_verdict, labels.answer, asked
            )
            reasoning_verdict, reasoning_loop = self._loop(
                reasoning_words, words.reasoning_worst, reasoning_verdict, labels.reasoning, asked
            )
        has_answer = answer_verdict is not Verdict.MISSING
        final = parsed.final or ""
        sentences = count_sentences(final[:MAX_ANSWER_CHARS_FOR_SENTENCES]) if has_answer else 0
        brief_ok = (
            has_answer
            and len(final) <= MAX_ANSWER_CHARS_FOR_SENTENCES
            and sentences <= self.max_answer_sentences
        )
        predicted = correct = None
        expected = _expected_number(expected_answer)
        if expected is not None:
            predicted = extract_numeric_answer(parsed.final, labels.answer) if has_answer else None
            correct = numbers_match(predicted, expected)
        degenerate = answer_loop is not None or reasoning_loop is not None
        judged = Judgement(answer_verdict, reasoning_verdict, brief_ok, correct, degenerate)
        components = {name: term.price(judged, w) for name, term in REWARD_TERMS.items()}
        low, high = self._bounds
        reward = min(max(math.fsum(components.values()), low), high)
        return ComplianceResult(
            reward=reward,
            components=components,
            parsed=parsed,
            labels=labels,
            answer_verdict=answer_verdict,
            reasoning_verdict=reasoning_verdict,
            answer_language=answer_language,
            reasoning_language=reasoning_language,
            answer_fraction=answer_fraction,
            reasoning_fraction=reasoning_fraction,
            answer_sentences=sentences,
            brief_ok=brief_ok,
            predicted_answer=predicted,
            correct=correct,
            answer_loop=answer_loop,
            reasoning_loop=reasoning_loop,
        )


_LETTER = re.compile(r"[^\W\d_]")
_DIGIT = re.compile(r"\d")


def _question(prompt: str) -> str:
    """The question of a prompt: its last user message when it is a harmony prompt."""
    asked = _USER_MESSAGE.findall(prompt)
    return asked[-1] if asked else prompt


def _enough_reasoning(tokens: Sequence[str], language: str) -> bool:
    """At least ``REASONING_MIN_WORDS`` words (``loop_words``), ``REASONING_MIN_REAL_WORDS``
    of them known in ``language``'s word list."""
    if len(tokens) < REASONING_MIN_WORDS:
        return False
    words = list(filterfalse(str.isdigit, tokens))
    return len(words) >= REASONING_MIN_REAL_WORDS and (
        known_word_share(words, language) * len(words) >= REASONING_MIN_REAL_WORDS
    )


def _has_content(tokens: Sequence[str], language: str) -> bool:
    """A number, or a word that is not one of ``language``'s function words (``tokens``:
    ``loop_words``; numbers are never function words)."""
    return not function_words(language).issuperset(tokens)


def _is_language_neutral(text: str) -> bool:
    """Digits and not one letter (``"42"``, ``"12,5 %"``): an answer no language owns."""
    return _DIGIT.search(text) is not None and _LETTER.search(text) is None


def _expected_number(value: object) -> float | None:
    """The expected answer as a finite float; strings are read like answers (``"1,5"``)."""
    if isinstance(value, str):
        value = extract_numeric_answer(value)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def result_to_dict(result: ComplianceResult) -> dict[str, object]:
    """A JSON-friendly dict of a result (for eval reports)."""
    data = asdict(result)
    data["answer_verdict"] = result.answer_verdict.value
    data["reasoning_verdict"] = result.reasoning_verdict.value
    data["parsed"]["format"] = result.parsed.format.value
    for part in ("answer_loop", "reasoning_loop"):
        data[part] = data[part] and str(data[part])  # the signal's name, or None
    data["labels"] = result.labels.to_label() if result.labels is not None else None
    data["components"] = dict(result.components)
    return data
