"""Benchmark offline language-ID libraries on lingo-rl's test sets; picks eval's backend.

Every other library runs through the rule fastText had alone
(``core.language_id.LanguageIdentifier`` without word evidence): fewer than 6 letters is
"und"; under 20 letters the top language needs probability >= 0.5, else "und"; a top
language outside en/fr/de/es/it is "other". So the comparison is between the libraries'
models, not between wrappers. Ours is fastText with word evidence for text under 40 letters
(``core/word_evidence.py``); "fastText alone" is the same model with the rule above.

Test set: ``bench/data/langid_testset.jsonl``, one object per line:
``{"id", "kind", "label", "text"}`` with kind ``sentence`` (200, 40 per language), ``short``
(70, 2-5 words), ``mixed`` (40: mostly one language with a quote or term from another, or
two languages half and half, label ``none``), ``other`` (30, other languages, label
``other``) and ``undetermined`` (24: numbers, formulas, names; label ``und``).

Reported per library:
    * accuracy of ``identify`` (whole text, one label) on every row but the ``none`` ones;
    * accuracy on ``mixed`` rows of the per-sentence verdict (``profile``: the language with
      at least 65% of the judged letters, else ``none``), which is what the reward uses;
    * sentences/s of ``identify`` over the 200 ``sentence`` rows on one core, and load time;
    * for the fastText identifiers, texts/s of ``profiles`` (what the reward calls) over all
      rows of the test set at once, best of ``--repeat`` passes.

Short phrases: ``bench/data/short_phrases.jsonl``, one object per line ``{"id", "label",
"text"}``: 2-6-word phrases in each language (65 each), texts without language evidence
(label ``und``: numbers, names, code) and short phrases in other languages (``other``).
Reported: accuracy on the five languages' phrases (abstaining counts as wrong), and the share
of ``und`` and ``other`` rows identified as such.

Usage::

    python bench/language_id.py [--testset PATH] [--short PATH] [--repeat 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.language_id import LanguageIdentifier  # noqa: E402
from reward.scoring import MIN_LANGUAGE_FRACTION  # noqa: E402

logger = logging.getLogger("bench.language_id")

TESTSET = Path(__file__).resolve().parent / "data" / "langid_testset.jsonl"
SHORT_PHRASES = Path(__file__).resolve().parent / "data" / "short_phrases.jsonl"


def load_testset(path: Path) -> list[dict[str, str]]:
    """Rows of the JSONL test set."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _fasttext() -> LanguageIdentifier:
    return LanguageIdentifier()


def _fasttext_alone() -> LanguageIdentifier:
    return LanguageIdentifier(short_text_evidence=False)


def _py3langid() -> LanguageIdentifier:
    from py3langid.langid import MODEL_FILE
    from py3langid.langid import LanguageIdentifier as Py3

    model = Py3.from_model_file(MODEL_FILE, norm_probs=True)
    return LanguageIdentifier(top_language=model.classify)


def _lingua() -> LanguageIdentifier:
    from lingua import LanguageDetectorBuilder

    detector = LanguageDetectorBuilder.from_all_languages().with_preloaded_language_models().build()

    def top(text: str) -> tuple[str, float]:
        values = detector.compute_language_confidence_values(text)
        if not values:
            return "und", 0.0
        best = values[0]
        return best.language.iso_code_639_1.name.lower(), best.value

    return LanguageIdentifier(top_language=top)


def _langdetect() -> LanguageIdentifier:
    from langdetect import DetectorFactory, detect_langs
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = 0

    def top(text: str) -> tuple[str, float]:
        try:
            best = detect_langs(text)[0]
        except LangDetectException:
            return "und", 0.0
        return best.lang, best.prob

    return LanguageIdentifier(top_language=top)


BACKENDS: dict[str, Callable[[], LanguageIdentifier]] = {
    "fasttext-lid176 + word evidence (ours)": _fasttext,
    "fasttext-lid176 alone (previous rule)": _fasttext_alone,
    "py3langid": _py3langid,
    "lingua (all languages)": _lingua,
    "langdetect": _langdetect,
}


def mixed_verdict(identifier: LanguageIdentifier, text: str) -> str:
    """The language holding at least MIN_LANGUAGE_FRACTION of the text, else ``none``."""
    profile = identifier.profile(text)
    if not profile.determined:
        return "und"
    best = profile.dominant
    return best if profile.fraction(best) >= MIN_LANGUAGE_FRACTION else "none"


def evaluate_short(identifier: LanguageIdentifier, rows: list[dict[str, str]]) -> dict:
    """Accuracy on the short-phrase set: the five languages' phrases, ``und`` and ``other``."""
    correct: Counter[str] = Counter()
    total: Counter[str] = Counter()
    errors: list[str] = []
    for row in rows:
        group = row["label"] if row["label"] in ("und", "other") else "languages"
        predicted = identifier.identify(row["text"])
        total[group] += 1
        if predicted == row["label"]:
            correct[group] += 1
        else:
            errors.append(f"{row['id']}: {predicted} != {row['label']} ({row['text']})")
    return {
        "accuracy": {group: correct[group] / total[group] for group in total},
        "counts": {group: f"{correct[group]}/{total[group]}" for group in total},
        "errors": errors,
    }


def profiles_per_second(identifier: LanguageIdentifier, texts: list[str], repeat: int) -> float:
    """Texts/s of ``profiles`` over ``texts`` at once, best of ``repeat`` passes (warm)."""
    identifier.profiles(texts)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        identifier.profiles(texts)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def evaluate(identifier: LanguageIdentifier, rows: list[dict[str, str]], repeat: int) -> dict:
    """Accuracy by kind, per-sentence accuracy on mixed rows, and speed."""
    correct: Counter[str] = Counter()
    total: Counter[str] = Counter()
    errors: list[str] = []
    for row in rows:
        if row["label"] == "none":
            continue
        predicted = identifier.identify(row["text"])
        total[row["kind"]] += 1
        if predicted == row["label"]:
            correct[row["kind"]] += 1
        else:
            errors.append(f"{row['id']}: {predicted} != {row['label']}")
    mixed = [r for r in rows if r["kind"] == "mixed"]
    mixed_ok = sum(mixed_verdict(identifier, r["text"]) == r["label"] for r in mixed)
    sentences = [r["text"] for r in rows if r["kind"] == "sentence"]
    start = time.perf_counter()
    for _ in range(repeat):
        for text in sentences:
            identifier.identify(text)
    elapsed = time.perf_counter() - start
    n = sum(total.values())
    return {
        "accuracy": sum(correct.values()) / n,
        "by_kind": {k: f"{correct[k]}/{total[k]}" for k in total},
        "mixed_by_sentence": f"{mixed_ok}/{len(mixed)}",
        "mixed_by_sentence_accuracy": mixed_ok / len(mixed),
        "sentences_per_s": repeat * len(sentences) / elapsed,
        "errors": errors,
    }


def _pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and log a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testset", type=Path, default=TESTSET)
    parser.add_argument("--short", type=Path, default=SHORT_PHRASES, help="short-phrase set")
    parser.add_argument("--repeat", type=int, default=20, help="timing passes over sentences")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--errors", action="store_true", help="list misidentified rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _pin_one_core()
    rows = load_testset(args.testset)
    short_rows = load_testset(args.short)
    kinds = Counter(r["kind"] for r in rows)
    logger.info(
        "test set: %d rows %s; one core; %d timing passes", len(rows), dict(kinds), args.repeat
    )
    results: dict[str, dict] = {}
    for name, build in BACKENDS.items():
        try:
            start = time.perf_counter()
            identifier = build()
            identifier.identify("warm up the model with a sentence")
            load_s = time.perf_counter() - start
        except ImportError as err:
            logger.info("%-40s skipped: %s", name, err)
            continue
        result = evaluate(identifier, rows, args.repeat)
        result["load_s"] = load_s
        result["short_phrases"] = evaluate_short(identifier, short_rows)
        if identifier.model_path is not None:
            texts = [r["text"] for r in rows]
            result["profiles_per_s"] = profiles_per_second(identifier, texts, args.repeat)
        results[name] = result
        logger.info(
            "%-40s acc %.3f  %s  mixed per-sentence %s  %8.0f sent/s  load %.2fs",
            name,
            result["accuracy"],
            " ".join(f"{k}={v}" for k, v in result["by_kind"].items()),
            result["mixed_by_sentence"],
            result["sentences_per_s"],
            load_s,
        )
        if args.errors:
            for line in result["errors"] + result["short_phrases"]["errors"]:
                logger.info("    %s", line)
    logger.info("")
    logger.info("short phrases (%s, %d rows):", args.short.name, len(short_rows))
    logger.info(
        "%-40s %-18s %-10s %-10s %s", "library", "5 languages", "und", "other", "profiles/s"
    )
    for name, result in results.items():
        short = result["short_phrases"]
        accuracy, counts = short["accuracy"], short["counts"]
        logger.info(
            "%-40s %-18s %-10s %-10s %s",
            name,
            f"{accuracy['languages']:.3f} ({counts['languages']})",
            counts["und"],
            counts["other"],
            f"{result['profiles_per_s']:,.0f}" if "profiles_per_s" in result else "-",
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
