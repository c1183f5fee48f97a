import json
import os
from collections import Counter

import pytest
from conftest import make_row, make_rows, read_jsonl, write_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.atomic import OUTPUT_RECORD
from data_prep.config import DataPrepConfig
from data_prep.prepare import (
    EmptyDatasetError,
    TooManyBadRowsError,
    eval_count,
    prepare_dataset,
)
from data_prep.sources import SourceError
from data_prep.validate import DUPLICATE


def _run(tmp_path, source, **config):
    out = tmp_path / "out"
    report = prepare_dataset(
        DataPrepConfig(source=str(source), **config),
        out / "train.jsonl",
        out / "eval.jsonl",
        out / "quarantine.jsonl",
        out / "card.md",
    )
    return report, out


def _ids(path):
    return [r["id"] for r in read_jsonl(path)]


def test_every_row_lands_in_exactly_one_output(tmp_path):
    rows = make_rows(20)
    bad = ["{not json", json.dumps([1, 2]), json.dumps(make_row("Klingon"))]
    src = write_jsonl(tmp_path / "in.jsonl", rows + [rows[0]] + bad)
    report, out = _run(tmp_path, src, max_bad_fraction=0.5)
    train, evaluation = read_jsonl(out / "train.jsonl"), read_jsonl(out / "eval.jsonl")
    quarantine = read_jsonl(out / "quarantine.jsonl")
    assert len(train) + len(evaluation) == 100
    assert len(quarantine) == 4
    assert report.rows_read == 104 and report.rows_duplicate == 1 and report.rows_bad == 3
    dup = next(q for q in quarantine if q["reason"] == DUPLICATE)
    assert dup["row"] == 100 and dup["detail"] == "exact duplicate of row 0"
    assert {q["origin"] for q in quarantine} == {f"in.jsonl:{n}" for n in (101, 102, 103, 104)}
    broken = next(q for q in quarantine if q["reason"] == "invalid_json")
    assert broken["raw"] == "{not json"  # nothing is lost
    assert not set(_ids(out / "train.jsonl")) & set(_ids(out / "eval.jsonl"))


def test_split_is_stratified_and_deterministic(tmp_path):
    rows = make_rows(30)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report, out = _run(tmp_path, src, eval_fraction=0.2, seed=7)
    by_lang = Counter(r["reasoning_language"] for r in read_jsonl(out / "eval.jsonl"))
    assert by_lang == {lang: 6 for lang in ("en", "fr", "de", "es", "it")}
    first = _ids(out / "eval.jsonl")
    # same seed, rows in another order → same eval set
    src2 = write_jsonl(tmp_path / "rev" / "in.jsonl", list(reversed(rows)))
    _, out2 = _run(tmp_path / "rev", src2, eval_fraction=0.2, seed=7)
    assert sorted(_ids(out2 / "eval.jsonl")) == sorted(first)
    # another seed → another eval set of the same size
    _, out3 = _run(tmp_path / "s8", src, eval_fraction=0.2, seed=8)
    assert len(_ids(out3 / "eval.jsonl")) == 30
    assert sorted(_ids(out3 / "eval.jsonl")) != sorted(first)


@pytest.mark.parametrize(
    "n, fraction, expected",
    [(0, 0.1, 0), (1, 0.5, 0), (2, 0.01, 1), (10, 0.1, 1), (10, 0.0, 0), (5, 0.9, 4)],
)
def test_eval_count(n, fraction, expected):
    assert eval_count(n, fraction) == expected


def test_too_many_bad_rows_fails_naming_file_and_rows_but_keeps_quarantine(tmp_path):
    rows = make_rows(2) + ["{oops"] * 3
    src = write_jsonl(tmp_path / "data" / "mixed.jsonl", rows)
    with pytest.raises(TooManyBadRowsError) as err:
        _run(tmp_path, tmp_path / "data", max_bad_fraction=0.1)
    message = str(err.value)
    assert str(tmp_path / "data") in message
    assert "row 10 (mixed.jsonl:11)" in message and "3 of 13 rows" in message
    out = tmp_path / "out"
    assert not (out / "train.jsonl").exists() and not (out / "eval.jsonl").exists()
    assert len(read_jsonl(out / "quarantine.jsonl")) == 3
    left = [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != OUTPUT_RECORD]
    assert left == []  # no temp files left
    assert src.exists()


def test_empty_source_is_an_error(tmp_path):
    src = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(EmptyDatasetError, match="no valid rows"):
        _run(tmp_path, src)


def test_a_failed_run_leaves_no_older_train_eval_beside_its_quarantine(tmp_path):
    # issue #17: on main the earlier run's train/eval stayed beside the failed run's
    # quarantine, a complete-looking but stale output
    src = write_jsonl(tmp_path / "in.jsonl", make_rows(4))
    _run(tmp_path, src)
    out = tmp_path / "out"
    assert (out / "train.jsonl").exists() and (out / "card.md").exists()
    write_jsonl(tmp_path / "in.jsonl", [{"wrong": "columns"}] * 5)
    with pytest.raises(TooManyBadRowsError):
        _run(tmp_path, src)
    assert sorted(p.name for p in out.iterdir() if p.name != OUTPUT_RECORD) == ["quarantine.jsonl"]
    assert len(read_jsonl(out / "quarantine.jsonl")) == 5


def test_a_source_that_cannot_be_read_leaves_the_earlier_outputs_whole(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", make_rows(4))
    _run(tmp_path, src)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(SourceError):
        _run(tmp_path, tmp_path / "missing.jsonl")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_records_carry_labels_prompt_and_completion(tmp_path):
    rows = [
        make_row("German", user="Wie spät ist es in Tokio, wenn es in Berlin zwölf Uhr ist?"),
        make_row("Italian"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    _, out = _run(tmp_path, src, eval_fraction=0.0)
    records = {r["reasoning_language"]: r for r in read_jsonl(out / "train.jsonl")}
    de, it = records["de"], records["it"]
    assert (de["answer_language"], de["label"], de["answer_language_source"]) == (
        "de",
        "de",
        "user",
    )
    assert (it["answer_language"], it["label"]) == ("en", "it/en")
    assert it["prompt"].endswith("<|start|>assistant")
    assert it["completion"].startswith("<|channel|>analysis<|message|>")
    assert it["completion"].endswith("<|return|>")
    assert it["messages"][2]["thinking"] == it["analysis"]
    assert oct(os.stat(out / "train.jsonl").st_mode & 0o777) != "0o600"


def test_same_as_reasoning_policy(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [make_row("Spanish")])
    _, out = _run(tmp_path, src, eval_fraction=0.0, answer_language_policy="same-as-reasoning")
    (record,) = read_jsonl(out / "train.jsonl")
    assert (record["answer_language"], record["label"]) == ("es", "es")
    assert "answer language: Spanish" in record["prompt"]


def test_card_reports_counts_and_reasons(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", make_rows(10) + ["{x"])
    _run(tmp_path, src, eval_fraction=0.2, max_bad_fraction=0.5)
    card = (tmp_path / "out" / "card.md").read_text()
    assert "| French (fr) | 8 | 2 |" in card
    assert "| invalid_json | 1 |" in card
    assert "**40**" in card and "**10**" in card


_text = st.one_of(
    st.text(max_size=50),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30),
    st.sampled_from(["", " ", "\x00", "\ud800", "x" * 5000, "French", "fr", "Deutsch"]),
)
_value = st.one_of(
    _text, st.none(), st.integers(), st.floats(allow_nan=True), st.lists(_text, max_size=3)
)
_hostile_row = st.one_of(
    st.builds(make_row, st.sampled_from(["French", "German", "xx", ""]), _text.filter(bool)),
    st.dictionaries(
        st.sampled_from(
            ["reasoning_language", "developer", "user", "analysis", "final", "messages", "extra"]
        ),
        _value,
        max_size=7,
    ),
    st.lists(_value, max_size=3),
    _value,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=st.lists(_hostile_row, min_size=1, max_size=12))
def test_hostile_rows_never_crash_and_every_row_is_accounted_for(tmp_path_factory, rows):
    tmp = tmp_path_factory.mktemp("hostile")
    src = tmp / "in.jsonl"
    with src.open("w", encoding="utf-8", errors="surrogatepass") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    out = tmp / "out"
    try:
        report = prepare_dataset(
            DataPrepConfig(source=str(src), max_bad_fraction=1.0, max_field_chars=1000),
            out / "train.jsonl",
            out / "eval.jsonl",
            out / "quarantine.jsonl",
        )
    except EmptyDatasetError:
        assert len(read_jsonl(out / "quarantine.jsonl")) == len(rows)
        return
    counted = sum(
        len(read_jsonl(out / name)) for name in ("train.jsonl", "eval.jsonl", "quarantine.jsonl")
    )
    assert counted == len(rows) == report.rows_read


def test_augmentation_adds_synthetic_train_rows_in_the_right_languages(tmp_path):
    from core.language_id import identify_language

    src = write_jsonl(tmp_path / "in.jsonl", make_rows(10))
    report, out = _run(tmp_path, src, eval_fraction=0.2, augment_factor=3)
    train = read_jsonl(out / "train.jsonl")
    synthetic = [r for r in train if r.get("synthetic")]
    assert report.synthetic_rows == len(synthetic) == 3 * report.train_rows
    eval_ids = {r["id"] for r in read_jsonl(out / "eval.jsonl")}
    originals = {r["id"]: r for r in train if not r.get("synthetic")}
    for record in synthetic:
        base = originals[record["origin"].split(":")[1]]
        assert record["prompt"] == base["prompt"] and record["label"] == base["label"]
        assert identify_language(record["analysis"]) in (record["reasoning_language"], "und")
        assert record["origin"].split(":")[1] not in eval_ids  # built from train rows only
    again, out2 = _run(tmp_path / "again", src, eval_fraction=0.2, augment_factor=3)
    assert (out2 / "train.jsonl").read_text() == (out / "train.jsonl").read_text()
