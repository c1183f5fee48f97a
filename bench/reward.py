"""Our language-compliance reward vs the reference recipe's, side by side on the same responses.

The reference is OpenRLHF's gpt-oss-20b multilingual GRPO recipe (AWS): +5/-5 for the final
answer's language, +1.5/-1.5 for the reasoning's, +0.5/-1.0 for an answer of at most two
sentences. It is re-implemented here from its description (:func:`reference_reward`):
``langdetect`` with ``DetectorFactory.seed = 0``; a text is judged only with at least 20
characters after cleaning (special tokens removed, whitespace stripped), otherwise it counts
as wrong; the decoded output is split with ``assistantanalysis(.*?)assistantfinal(.*)``
(no match: no reasoning, the whole text is the answer); sentences are counted with
``re.split(r"[.!?]+", …)``.

Responses are built from ``bench/data/langid_testset.jsonl`` with a fixed seed, in the
decoded form both parsers read (``assistantanalysis…assistantfinal…``), with known truth
for "the answer is in the answer language" and "the reasoning is in the reasoning language":

==========================  ==============================================================
compliant                   reasoning 3-6 sentences in R, answer 1-2 sentences in A
wrong_answer_language       answer in another language
wrong_reasoning_language    reasoning in another language
short_answer                answer is one short phrase (2-5 words), in A or not
mixed_mostly                reasoning with one sentence in another language; answer a text
                            mostly in A with a quote or term in another language
mixed_half                  reasoning half R, half another language; answer half and half
truncated                   no final channel (cut off by the token limit)
loop                        the reasoning or the answer is a loop: the first 2-4 words of a
                            sentence in its language, said again and again (as the demo's
                            GRPO policy did, issue #29)
==========================  ==============================================================

Accuracy is the share of (response, part) verdicts that match the truth; an undetermined
verdict counts as "not in the language". Throughput is responses/s on one core.

Usage::

    python bench/reward.py [--per-category 100] [--rounds 3] [--reasoning-sentences 3 6]
                           [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.languages import SUPPORTED_LANGUAGES  # noqa: E402
from reward.scoring import ComplianceScorer  # noqa: E402

logger = logging.getLogger("bench.reward")

TESTSET = Path(__file__).resolve().parent / "data" / "langid_testset.jsonl"
CATEGORIES = (
    "compliant",
    "wrong_answer_language",
    "wrong_reasoning_language",
    "short_answer",
    "mixed_mostly",
    "mixed_half",
    "truncated",
    "loop",
)

# -- the reference recipe's reward, re-implemented -------------------------------------------

_REFERENCE_SPLIT = re.compile(r"assistantanalysis(.*?)assistantfinal(.*)", re.DOTALL)
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")
_REFERENCE_MIN_CHARS = 20


@dataclass(frozen=True)
class ReferenceResult:
    """The reference reward and the languages it detected (``None``: not judged)."""

    reward: float
    answer_language: str | None
    reasoning_language: str | None


def _reference_detect(text: str) -> str | None:
    from langdetect import DetectorFactory, detect
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = 0
    text = _SPECIAL.sub("", text).strip()
    if len(text) < _REFERENCE_MIN_CHARS:
        return None
    try:
        return detect(text)
    except LangDetectException:
        return None


def reference_reward(
    response: str, reasoning_language: str, answer_language: str
) -> ReferenceResult:
    """The reference recipe's reward for one decoded response."""
    match = _REFERENCE_SPLIT.search(response)
    if match:
        reasoning, final = match.group(1).strip(), match.group(2).strip()
    else:
        reasoning, final = "", response.strip()
    answer = _reference_detect(final)
    thought = _reference_detect(reasoning)
    reward = 5.0 if answer == answer_language else -5.0
    reward += 1.5 if thought == reasoning_language else -1.5
    sentences = [s for s in re.split(r"[.!?]+", final) if s.strip()]
    reward += 0.5 if len(sentences) <= 2 else -1.0
    return ReferenceResult(reward, answer, thought)


# -- test responses --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A response with its labels and the truth about it."""

    category: str
    response: str
    reasoning_language: str
    answer_language: str
    answer_ok: bool
    reasoning_ok: bool


def build_cases(
    rows: list[dict[str, str]],
    per_category: int,
    seed: int = 0,
    reasoning_sentences: tuple[int, int] = (3, 6),
) -> list[Case]:
    """Responses for every category, ``per_category`` each, deterministic for ``seed``.

    ``reasoning_sentences`` is the range of the number of sentences in the reasoning.
    """
    low, high = reasoning_sentences
    rng = random.Random(seed)
    sentences: dict[str, list[str]] = defaultdict(list)
    shorts: dict[str, list[str]] = defaultdict(list)
    mostly: dict[str, list[str]] = defaultdict(list)
    halves: list[str] = []
    for row in rows:
        if row["kind"] == "sentence":
            sentences[row["label"]].append(row["text"])
        elif row["kind"] == "short":
            shorts[row["label"]].append(row["text"])
        elif row["kind"] == "mixed" and row["label"] == "none":
            halves.append(row["text"])
        elif row["kind"] == "mixed":
            mostly[row["label"]].append(row["text"])
    langs = list(SUPPORTED_LANGUAGES)

    def other(lang: str) -> str:
        return rng.choice([x for x in langs if x != lang])

    def text(lang: str, low: int, high: int) -> str:
        return " ".join(rng.sample(sentences[lang], rng.randint(low, high)))

    def loop(lang: str, words: int) -> str:
        cycle = rng.choice(sentences[lang]).rstrip(".!?").split()[: rng.randint(2, 4)]
        return " ".join((cycle * words)[:words]) + "."

    def respond(reasoning: str, final: str | None) -> str:
        if final is None:
            return f"assistantanalysis{reasoning}"
        return f"assistantanalysis{reasoning}assistantfinal{final}"

    cases: list[Case] = []
    for category in CATEGORIES:
        for _ in range(per_category):
            r = rng.choice(langs)
            a = r if rng.random() < 0.7 else other(r)
            reasoning, final = text(r, low, high), text(a, 1, 2)
            answer_ok = reasoning_ok = True
            if category == "wrong_answer_language":
                final, answer_ok = text(other(a), 1, 2), False
            elif category == "wrong_reasoning_language":
                reasoning, reasoning_ok = text(other(r), low, high), False
            elif category == "short_answer":
                answer_ok = rng.random() < 0.5
                final = rng.choice(shorts[a] if answer_ok else shorts[other(a)])
            elif category == "mixed_mostly":
                # at least three sentences in R, so that the foreign one is a minority
                own = rng.sample(sentences[r], rng.randint(max(3, low), max(3, high - 1)))
                own.insert(rng.randint(1, len(own) - 1), rng.choice(sentences[other(r)]))
                reasoning = " ".join(own)
                final = rng.choice(mostly[a])
            elif category == "mixed_half":
                b = other(r)
                half = max(2, (low + high) // 4)
                pairs = zip(
                    rng.sample(sentences[r], half), rng.sample(sentences[b], half), strict=True
                )
                reasoning = " ".join(s for pair in pairs for s in pair)
                final, answer_ok, reasoning_ok = rng.choice(halves), False, False
            elif category == "truncated":
                final, answer_ok = None, False
            elif category == "loop" and rng.random() < 0.5:
                final, answer_ok = loop(a, rng.randint(12, 24)), False
            elif category == "loop":
                reasoning, reasoning_ok = loop(r, rng.randint(24, 60)), False
            cases.append(Case(category, respond(reasoning, final), r, a, answer_ok, reasoning_ok))
    return cases


# -- the benchmark ---------------------------------------------------------------------------


def _time_side_by_side(
    ours: Callable[[], list], reference: Callable[[], list], rounds: int
) -> tuple[float, float, list, list]:
    """Best-of-``rounds`` CPU time of this process for each, run alternately. CPU time, not
    wall time: on a shared machine other processes' load stretched the wall time of one side
    more than the other's (the same code read 23.8x and 35x a few minutes apart, 2026-12-06);
    both sides run on one core, so their CPU times are their costs. Each side starts after a
    full garbage collection: the collection one side's allocations made due otherwise fell on
    the other side's first allocation (a full walk of both sides' models: +100 ms to our
    800 responses, 2026-12-08)."""
    ours_s = reference_s = float("inf")
    ours_out: list = []
    reference_out: list = []
    for _ in range(rounds):
        gc.collect()
        start = time.process_time()
        ours_out = ours()
        ours_s = min(ours_s, time.process_time() - start)
        gc.collect()
        start = time.process_time()
        reference_out = reference()
        reference_s = min(reference_s, time.process_time() - start)
    return ours_s, reference_s, ours_out, reference_out


def run(
    per_category: int,
    rounds: int,
    testset: Path = TESTSET,
    reasoning_sentences: tuple[int, int] = (3, 6),
) -> dict:
    """Score the same responses with both rewards; accuracy by category and throughput."""
    with testset.open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    cases = build_cases(rows, per_category, reasoning_sentences=reasoning_sentences)
    responses = [c.response for c in cases]
    labels = [f"{c.reasoning_language}/{c.answer_language}" for c in cases]
    scorer = ComplianceScorer()
    scorer.score("warm up", "en")  # model loading is not timed
    reference_reward("assistantanalysiswarm up the detector.assistantfinalwarm up.", "en", "en")

    def score_reference() -> list[ReferenceResult]:
        return [
            reference_reward(case.response, case.reasoning_language, case.answer_language)
            for case in cases
        ]

    ours_s, ref_s, ours, ref = _time_side_by_side(
        lambda: scorer.score_batch(responses, labels), score_reference, rounds
    )
    tallies: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for case, mine, theirs in zip(cases, ours, ref, strict=True):
        t = tallies[case.category]
        t["verdicts"] += 2
        t["ours"] += (mine.answer_language_ok == case.answer_ok) + (
            mine.reasoning_language_ok == case.reasoning_ok
        )
        t["reference"] += ((theirs.answer_language == case.answer_language) == case.answer_ok) + (
            (theirs.reasoning_language == case.reasoning_language) == case.reasoning_ok
        )

    def accuracy(keys: tuple[str, ...], who: str) -> float:
        return sum(tallies[k][who] for k in keys) / sum(tallies[k]["verdicts"] for k in keys)

    by_category = {
        k: {"ours": accuracy((k,), "ours"), "reference": accuracy((k,), "reference")}
        for k in CATEGORIES
    }
    return {
        "responses": len(cases),
        "reasoning_sentences": list(reasoning_sentences),
        "mean_response_chars": sum(map(len, responses)) / len(responses),
        "ours_responses_per_s": len(cases) / ours_s,
        "reference_responses_per_s": len(cases) / ref_s,
        "speedup": ref_s / ours_s,
        "accuracy": {who: accuracy(CATEGORIES, who) for who in ("ours", "reference")},
        "accuracy_short": by_category["short_answer"],
        "accuracy_mixed": {
            who: accuracy(("mixed_mostly", "mixed_half"), who) for who in ("ours", "reference")
        },
        "by_category": by_category,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and log the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (best is kept)")
    parser.add_argument(
        "--reasoning-sentences",
        type=int,
        nargs=2,
        default=(3, 6),
        metavar=("MIN", "MAX"),
        help="sentences in each reasoning (longer reasoning: e.g. 20 40)",
    )
    parser.add_argument("--testset", type=Path, default=TESTSET)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    result = run(args.per_category, args.rounds, args.testset, tuple(args.reasoning_sentences))
    logger.info(
        "%d responses (reasoning %d-%d sentences, mean %.0f chars), one core",
        result["responses"],
        *result["reasoning_sentences"],
        result["mean_response_chars"],
    )
    logger.info("%-26s %10s %10s", "accuracy", "ours", "reference")
    for name, acc in result["by_category"].items():
        logger.info("%-26s %10.3f %10.3f", name, acc["ours"], acc["reference"])
    for name in ("accuracy_short", "accuracy_mixed", "accuracy"):
        acc = result[name]
        label = name.replace("accuracy_", "") + " (all)"
        logger.info("%-26s %10.3f %10.3f", label, acc["ours"], acc["reference"])
    logger.info(
        "throughput: ours %.0f responses/s, reference %.0f responses/s, ratio %.1fx",
        result["ours_responses_per_s"],
        result["reference_responses_per_s"],
        result["speedup"],
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
