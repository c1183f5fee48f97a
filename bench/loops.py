"""The loop check's thresholds against real text and against the demo's loops.

Two sides of each threshold of ``reward.degeneracy.LoopDetector``:

* **real text must pass**: every bundled training row's reasoning and final answer (data
  prep's labels, no synthetic rows) and every eval question, in the five languages; prints,
  per part and language, how many texts the detector flags (the false-positive rate) and the
  worst value of each signal beside its threshold (the margin);
* **loops must not**: with ``--results`` (an eval's ``results.json``, or a run directory:
  its eval's ``evaluate/results``), every response is scored again twice, by the identifier
  alone (``ComplianceScorer(loop_detector=None)``: the reward before the LOOP verdict) and
  with the loop check; prints per model and language the both-language accuracy of each, the
  parts that turn to LOOP by signal, and examples.

Usage::

    python bench/loops.py [--results runs/local/lingo-rl-…] [--examples 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.languages import SUPPORTED_LANGUAGES  # noqa: E402
from data_prep.config import DataPrepConfig  # noqa: E402
from data_prep.prepare import prepare_dataset  # noqa: E402
from eval.runner import BUNDLED_QUESTIONS  # noqa: E402
from generation.requests import Generation  # noqa: E402
from reward.degeneracy import LoopDetector, known_word_share, loop_words, window_extremes  # noqa: E402
from reward.scoring import ComplianceScorer, Verdict  # noqa: E402

logger = logging.getLogger("bench.loops")


def real_texts(work: Path) -> list[tuple[str, str, str]]:
    """``(part, language, text)`` of every bundled row's reasoning (``analysis``) and final
    answer (``final``), labelled by data prep (no synthetic rows), and every eval question
    (``question``)."""
    train, held_out = work / "train.jsonl", work / "eval.jsonl"
    prepare_dataset(DataPrepConfig(augment_factor=0), train, held_out, work / "quarantine.jsonl")
    texts = []
    for path in (train, held_out):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            texts.append(("analysis", row["reasoning_language"], row["analysis"]))
            texts.append(("final", row["answer_language"], row["final"]))
    for line in BUNDLED_QUESTIONS.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts.append(("question", row["language"], row["question"]))
    return texts


MEASURES = ("repeated_bigrams", "distinct_ratio", "dominant_share", "known_share")
WORST = {  # the worst value of each measure for real text (a loop lies beyond it)
    "repeated_bigrams": max,
    "distinct_ratio": min,
    "dominant_share": max,
    "known_share": min,
}


def signals(text: str, language: str, detector: LoopDetector) -> dict[str, float]:
    """The measures the detector compares with its thresholds (NaN: too few words)."""
    tokens = loop_words(text)
    if len(tokens) < detector.min_words:
        return dict.fromkeys(MEASURES, math.nan)
    worst = window_extremes(tokens, detector.window, detector.min_dominant_count)
    words = [token for token in tokens if not token.isdigit()]
    known = known_word_share(words, language) if len(words) >= detector.min_words else math.nan
    return {
        "repeated_bigrams": worst.repeated_bigrams,
        "distinct_ratio": worst.distinct_ratio,
        "dominant_share": worst.dominant_share,
        "known_share": known,
    }


def real_text_margins(texts: list[tuple[str, str, str]], detector: LoopDetector) -> list[dict]:
    """Per (part, language): texts, texts judged (enough words), flagged, and each signal's
    worst value."""
    groups: dict[tuple[str, str], list[tuple[str, dict[str, float], bool]]] = defaultdict(list)
    for part, language, text in texts:
        measured = signals(text, language, detector)
        flagged = detector.signal(text, language) is not None
        groups[(part, language)].append((text, measured, flagged))
    rows = []
    for (part, language), items in sorted(groups.items()):
        judged = [m for _, m, _ in items if not math.isnan(m["distinct_ratio"])]
        row = {
            "part": part,
            "language": language,
            "texts": len(items),
            "judged": len(judged),
            "flagged": sum(f for _, _, f in items),
        }
        for name, worst in WORST.items():
            values = [m[name] for m in judged if not math.isnan(m[name])]
            row[name] = worst(values) if values else math.nan
        rows.append(row | {"flagged_texts": [t for t, _, f in items if f]})
    return rows


def _load_results(path: Path) -> dict:
    if path.is_dir():  # a run directory (its eval's `results` artifact) or an eval's output
        found = [p for p in sorted(path.glob("**/evaluate/results")) if p.is_file()]
        found = found or sorted(path.glob("**/results.json"))
        if not found:
            raise FileNotFoundError(f"{path}: no evaluate/results or results.json under it")
        path = found[-1]
    return json.loads(path.read_text(encoding="utf-8"))


def demo_loops(results: dict, detector: LoopDetector, examples: int) -> dict:
    """Every response of an eval scored by the identifier alone and with the loop check."""
    alone = ComplianceScorer(loop_detector=None)
    checked = ComplianceScorer(loop_detector=detector)
    by_model: dict[str, dict] = {}
    for model in [m["label"] for m in results["models"]]:
        responses = [r for r in results["responses"] if r["model"] == model and not r["error"]]
        texts = [  # parsed as the eval parsed them: a `length` finish cuts the answer off
            Generation(r["text"], r["reasoning_field"], r["finish_reason"]).parsed()
            for r in responses
        ]
        labels = [r["language"] for r in responses]
        before = alone.score_batch(texts, labels)
        after = checked.score_batch(texts, labels)
        table: dict[str, dict] = {}
        for language in SUPPORTED_LANGUAGES:
            chosen = [i for i, lab in enumerate(labels) if lab == language]
            signals_found: Counter[str] = Counter()
            loops = []
            for i in chosen:
                for part in ("reasoning", "answer"):
                    reason = getattr(after[i], f"{part}_loop")
                    if reason is not None:
                        signals_found[f"{part}:{reason}"] += 1
                        text = getattr(after[i].parsed, "final" if part == "answer" else part)
                        loops.append(f"[{part}, {reason}] {text}")
            both = [
                sum(
                    r.answer_language_ok and r.reasoning_language_ok for r in (s[i] for i in chosen)
                )
                / max(len(chosen), 1)
                for s in (before, after)
            ]
            table[language] = {
                "responses": len(chosen),
                "both_language_accuracy_identifier_alone": both[0],
                "both_language_accuracy_with_loop_check": both[1],
                "loops_by_part_and_signal": dict(signals_found),
                "examples": loops[:examples],
            }
        loop_parts = sum(
            (r.answer_verdict is Verdict.LOOP) + (r.reasoning_verdict is Verdict.LOOP)
            for r in after
        )
        by_model[model] = {
            "responses": len(responses),
            "loop_parts": loop_parts,
            "languages": table,
        }
    return by_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="an eval's results.json or a run directory")
    parser.add_argument("--examples", type=int, default=5, help="loops shown per language")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    detector = LoopDetector()
    print(f"loop detector: {detector}")
    with tempfile.TemporaryDirectory(prefix="bench-loops-") as work:
        texts = real_texts(Path(work))
    margins = real_text_margins(texts, detector)
    flagged = sum(row["flagged"] for row in margins)
    print(
        f"\nreal text: {len(texts)} texts, {flagged} flagged "
        f"(false-positive rate {flagged / len(texts):.4f})"
    )
    names = {name: f"{fn.__name__} {name}" for name, fn in WORST.items()}
    print(f"{'part':<9}{'lang':<5}{'texts':>6}{'judged':>7}{'flagged':>8}"
          + "".join(f"{title:>22}" for title in names.values()))  # fmt: skip
    for row in margins:
        print(
            f"{row['part']:<9}{row['language']:<5}{row['texts']:>6}{row['judged']:>7}"
            f"{row['flagged']:>8}" + "".join(f"{row[name]:>22.3f}" for name in names)
        )
        for text in row["flagged_texts"]:
            print(f"    flagged: {text}")
    overall = {name: fn(row[name] for row in margins) for name, fn in WORST.items()}
    print("all real text: " + ", ".join(f"{names[k]} {v:.3f}" for k, v in overall.items()))
    print(
        f"thresholds (window {detector.window} words): repeated bigrams >= "
        f"{detector.max_repeated_bigrams}, distinct < {detector.min_distinct_ratio}, dominant "
        f">= {detector.max_dominant_share} (>= {detector.min_dominant_count} times), known < "
        f"{detector.min_known_share}; parts under {detector.min_words} words are not judged"
    )
    figures: dict = {"detector": vars(detector), "real_text": margins}
    if args.results:
        loops = demo_loops(_load_results(args.results), detector, args.examples)
        figures["demo"] = loops
        for model, found in loops.items():
            print(f"\n{model}: {found['responses']} responses, {found['loop_parts']} loop parts")
            for language, row in found["languages"].items():
                print(
                    f"  {language}: both-language accuracy "
                    f"{row['both_language_accuracy_identifier_alone']:.3f} (identifier alone) -> "
                    f"{row['both_language_accuracy_with_loop_check']:.3f} (with the loop check); "
                    f"loops {row['loops_by_part_and_signal'] or 'none'}"
                )
                for example in row["examples"]:
                    print(f"      {example[:220]}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
