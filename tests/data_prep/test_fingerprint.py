"""The data fingerprint: what it pins for each kind of source, and where it is recorded."""

from __future__ import annotations

import shutil

from data_prep.config import DataPrepConfig
from data_prep.fingerprint import UNKNOWN, data_fingerprint, source_state
from data_prep.prepare import prepare_dataset
from data_prep.sources import BUNDLED_DIR


def fingerprint(source, **settings) -> str:
    return data_fingerprint(DataPrepConfig(source=str(source), **settings)).sha256


def test_a_local_folder_is_pinned_by_its_files_bytes_and_names(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(BUNDLED_DIR, data, ignore=shutil.ignore_patterns("*.md"))
    first = fingerprint(data)
    assert fingerprint(data) == first  # nothing changed
    assert fingerprint(data, workers=2) == first  # shapes nothing
    assert fingerprint(data, eval_fraction=0.2) != first  # shapes the split
    assert fingerprint(data, seed=7) != first
    rows = data / "rows_es_it.jsonl"
    original = rows.read_bytes()
    rows.write_bytes(original.replace(b"a", b"b", 1))  # one byte, same size
    assert fingerprint(data) != first
    rows.write_bytes(original)
    assert fingerprint(data) == first
    rows.rename(data / "rows_es_it_v2.jsonl")
    assert fingerprint(data) != first
    (data / "notes.md").write_text("not data")  # not a data file: not read, not pinned
    rows_back = data / "rows_es_it_v2.jsonl"
    rows_back.rename(rows)
    assert fingerprint(data) == first


def test_the_bundled_sample_and_the_question_sets_are_pinned(tmp_path):
    bundled = data_fingerprint(DataPrepConfig())
    assert bundled.known and bundled.inputs["sources"][0]["kind"] == "bundled"
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"question": "Wie viel ist 2 + 2?"}\n')
    with_set = DataPrepConfig(question_sets=[{"source": str(questions)}])
    pinned = data_fingerprint(with_set).sha256
    questions.write_text('{"question": "Wie viel ist 2 + 3?"}\n')
    assert data_fingerprint(with_set).sha256 != pinned != bundled.sha256


def test_an_s3_prefix_is_pinned_by_etags_and_sizes(datasets_bucket):
    client = datasets_bucket
    client.put_object(Bucket="datasets", Key="mt/part-1.jsonl", Body=b'{"a": 1}\n')
    client.put_object(Bucket="datasets", Key="mt/readme.md", Body=b"not data")
    state = source_state("s3://datasets/mt/")
    (only,) = state["objects"]
    assert (only["key"], only["size"]) == ("mt/part-1.jsonl", 9)
    assert only["etag"] == client.head_object(Bucket="datasets", Key="mt/part-1.jsonl")[
        "ETag"
    ].strip('"')
    first = fingerprint("s3://datasets/mt/")
    client.put_object(Bucket="datasets", Key="mt/readme.md", Body=b"still not data")
    assert fingerprint("s3://datasets/mt/") == first
    client.put_object(Bucket="datasets", Key="mt/part-1.jsonl", Body=b'{"a": 2}\n')
    assert fingerprint("s3://datasets/mt/") != first  # same size, new ETag
    client.put_object(Bucket="datasets", Key="mt/part-2.jsonl", Body=b'{"a": 3}\n')
    assert len(source_state("s3://datasets/mt/")["objects"]) == 2


def test_a_hub_dataset_without_a_revision_is_unknown_and_never_unchanged(monkeypatch):
    """huggingface_hub refuses the look-up offline: no revision, so the fingerprint cannot pin
    the data and the run retrains (``eval.gate.data_decision``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    result = data_fingerprint(DataPrepConfig(source="someorg/some-dataset"))
    assert result.sha256 == UNKNOWN and not result.known
    assert result.inputs["sources"][0] == {
        "kind": "hub", "id": "someorg/some-dataset", "split": "train", "revision": None,
    }  # fmt: skip


def test_the_dataset_card_records_the_fingerprint(tmp_path):
    config = DataPrepConfig()
    out = [tmp_path / name for name in ("train.jsonl", "eval.jsonl", "quarantine.jsonl", "card")]
    report = prepare_dataset(config, *out)
    assert report.fingerprint == data_fingerprint(config)
    card = out[3].read_text()
    assert f"- data fingerprint: `{report.fingerprint.sha256}`" in card
    assert "  - 3 bundled file(s), sha256 and size" in card


def test_the_same_bytes_elsewhere_are_the_same_data(tmp_path):
    """A folder copied or moved keeps its fingerprint (the dataset card's included)."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        shutil.copytree(BUNDLED_DIR, folder, ignore=shutil.ignore_patterns("*.md"))
    assert fingerprint(first) == fingerprint(second)
