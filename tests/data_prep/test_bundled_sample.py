"""The bundled sample: the default data of the local run and of the tests."""

from collections import Counter

from conftest import read_jsonl

from core.language_id import identify_language
from core.languages import SUPPORTED_LANGUAGES, normalize_language
from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare_dataset
from data_prep.sources import iter_source, parse_row


def test_sample_has_enough_rows_per_language():
    rows = [parse_row(r).data for r in iter_source("bundled")]
    counts = Counter(normalize_language(r["reasoning_language"]) for r in rows)
    assert len(rows) >= 300
    assert all(counts[lang] >= 60 for lang in SUPPORTED_LANGUAGES), counts


def test_sample_is_clean_and_its_analysis_is_in_the_reasoning_language(tmp_path):
    report = prepare_dataset(
        DataPrepConfig(max_bad_fraction=0.0),
        tmp_path / "train.jsonl",
        tmp_path / "eval.jsonl",
        tmp_path / "quarantine.jsonl",
    )
    assert report.rows_bad == 0 and report.rows_duplicate == 0
    records = read_jsonl(tmp_path / "train.jsonl") + read_jsonl(tmp_path / "eval.jsonl")
    wrong = [
        r["id"] for r in records if identify_language(r["analysis"]) != r["reasoning_language"]
    ]
    assert len(wrong) <= len(records) * 0.02, wrong
    # the sample exercises both label cases: answer language equal to and different from reasoning
    assert any(r["answer_language"] == r["reasoning_language"] != "en" for r in records)
    assert any(r["answer_language"] != r["reasoning_language"] for r in records)
