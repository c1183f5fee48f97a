"""The shipped 50-question eval set: 10 problems × 5 languages with numeric answers."""

import json
from collections import Counter
from pathlib import Path

import eval as eval_pkg
from core.language_id import identify_language
from core.languages import SUPPORTED_LANGUAGES

EVAL_50 = Path(eval_pkg.__file__).parent / "data" / "eval_50.jsonl"
KEYS = {"id", "problem_id", "language", "category", "question", "expected_answer", "unit"}


def _rows():
    return [json.loads(line) for line in EVAL_50.read_text(encoding="utf-8").splitlines()]


def test_ten_problems_in_five_languages():
    rows = _rows()
    assert len(rows) == 50
    assert all(set(r) == KEYS for r in rows)
    assert Counter(r["language"] for r in rows) == {lang: 10 for lang in SUPPORTED_LANGUAGES}
    by_problem: dict[str, list] = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r)
        assert r["id"] == f"{r['problem_id']}-{r['language']}"
    assert len(by_problem) == 10
    for versions in by_problem.values():
        assert sorted(v["language"] for v in versions) == sorted(SUPPORTED_LANGUAGES)
        assert len({v["expected_answer"] for v in versions}) == 1  # same answer in every language
        assert isinstance(versions[0]["expected_answer"], int | float)


def test_questions_are_in_their_language():
    wrong = [
        r["id"] for r in _rows() if identify_language(r["question"]) not in (r["language"], "und")
    ]
    assert len(wrong) <= 2, wrong


def test_a_questions_file_with_a_byte_order_mark_loads_its_first_question(tmp_path):
    # issue #32 item 9: on main line 1 was "not a valid eval question" (the BOM before "{")
    from eval.runner import BUNDLED_QUESTIONS, load_questions

    path = tmp_path / "q.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + BUNDLED_QUESTIONS.read_bytes())
    assert load_questions(path) == load_questions(BUNDLED_QUESTIONS)
