"""Synthetic train examples by recombining sentences within a language (for tiny-model demos).

A model trained from scratch needs more examples than the bundled sample holds to learn the
one thing lingo-rl teaches — *which language to write in* — rather than memorize the rows.
Each synthetic example keeps a real train row's prompt and labels, and replaces its analysis
with 1–3 sentences drawn from the analyses written in the row's reasoning language and its
final answer with 1–2 sentences drawn from the finals written in the row's answer language.
The content no longer answers the question; the languages are right, which is what the
language-compliance task measures. Only train rows are used (eval rows never leak), the result
is deterministic for a seed, and synthetic records carry ``"synthetic": true``.

Off by default (``augment_factor = 0``); the ``tiny-cpu`` preset turns it on.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import orjson

from core.languages import LanguageLabels
from core.sentences import split_sentences
from data_prep.labels import RowLabels
from data_prep.records import build_record, content_key
from data_prep.validate import ValidRow


def append_synthetic(records_path: Path, out, factor: int, seed: int, reasoning_effort: str) -> int:
    """Append ``factor`` synthetic examples per record of ``records_path`` to ``out`` (binary).

    Returns how many were written.
    """
    records = [orjson.loads(line) for line in Path(records_path).read_bytes().splitlines() if line]
    records = [r for r in records if not r.get("prompt_only")]  # no answer to recombine
    if factor <= 0 or not records:
        return 0
    analysis_pool: dict[str, list[str]] = defaultdict(list)
    final_pool: dict[str, list[str]] = defaultdict(list)
    for record in records:
        analysis_pool[record["reasoning_language"]] += split_sentences(record["analysis"])
        final_pool[record["answer_language"]] += split_sentences(record["final"])
    rng = random.Random(f"augment:{seed}")
    added = 0
    for k in range(factor):
        for record in records:
            analyses = analysis_pool[record["reasoning_language"]]
            finals = final_pool[record["answer_language"]]
            if not analyses or not finals:
                continue
            row = ValidRow(
                reasoning_language=record["reasoning_language"],
                developer=record["developer"],
                user=record["user"],
                analysis=" ".join(rng.sample(analyses, min(len(analyses), rng.randint(1, 3)))),
                final=" ".join(rng.sample(finals, min(len(finals), rng.randint(1, 2)))),
            )
            labels = RowLabels(
                LanguageLabels(record["reasoning_language"], record["answer_language"]),
                record["user_language"],
                record["answer_language_source"],
            )
            origin = f"synthetic:{record['id']}:{k}"
            synthetic = build_record(row, labels, origin, content_key(row), reasoning_effort)
            synthetic["id"] = f"syn-{synthetic['id'][3:]}"
            synthetic["synthetic"] = True
            out.write(orjson.dumps(synthetic, option=orjson.OPT_APPEND_NEWLINE))
            added += 1
    return added
