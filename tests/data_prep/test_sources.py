import io
import json
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_row, make_rows, write_jsonl
from s3_server import moto_s3_server, s3_env

from data_prep.sources import (
    BUNDLED_DIR,
    SourceError,
    describe_source,
    iter_local,
    iter_s3,
    iter_source,
    parse_row,
    split_s3_uri,
)


def _read(path):
    return [parse_row(r) for r in iter_local(path)]


def test_jsonl_rows_keep_their_line_numbers_and_skip_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n\n" + "{broken\n" + json.dumps({"b": 2}) + "\n")
    rows = _read(path)
    assert [r.origin for r in rows] == ["a.jsonl:1", "a.jsonl:3", "a.jsonl:4"]
    assert [r.index for r in rows] == [0, 1, 2]
    assert (
        rows[1].data is None and rows[1].raw_text == "{broken" and "invalid JSON" in rows[1].error
    )
    assert rows[2].data == {"b": 2}


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([make_row(), make_row("German")]))
    rows = _read(path)
    assert [r.origin for r in rows] == ["rows.json[0]", "rows.json[1]"]
    assert rows[1].data["reasoning_language"] == "German"


def test_parquet_file_with_messages_struct(tmp_path):
    rows = make_rows(2)
    path = tmp_path / "train-00000.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    read = _read(path)
    assert [r.data for r in read] == rows
    assert read[3].origin == "train-00000.parquet[3]"


def test_directory_reads_every_data_file_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b" / "2.jsonl", [make_row("German")])
    write_jsonl(tmp_path / "a.jsonl", [make_row("French"), make_row("Italian")])
    pq.write_table(pa.Table.from_pylist([make_row("Spanish")]), tmp_path / "c.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    rows = _read(tmp_path)
    assert [r.origin for r in rows] == ["a.jsonl:1", "a.jsonl:2", "b/2.jsonl:1", "c.parquet[0]"]
    assert [r.index for r in rows] == [0, 1, 2, 3]


def test_errors_name_the_source(tmp_path):
    with pytest.raises(SourceError, match="no .jsonl"):
        list(iter_local(tmp_path))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(SourceError, match="unsupported file type"):
        list(iter_local(tmp_path / "x.csv"))
    with pytest.raises(SourceError, match="/no/such/path.jsonl: no such file"):
        describe_source("/no/such/path.jsonl")
    with pytest.raises(SourceError, match="not an existing file"):
        describe_source("not a source")
    with pytest.raises(SourceError, match="no bucket"):
        split_s3_uri("s3:///key")


def test_source_kinds(tmp_path):
    assert describe_source("bundled") == "bundled"
    assert describe_source("HuggingFaceH4/Multilingual-Thinking") == "hub"
    assert describe_source("s3://bucket/data/") == "s3"
    assert describe_source(str(tmp_path)) == "local"


def test_a_corrupt_parquet_file_in_a_directory_is_named(tmp_path):
    # issue #17: on main "ArrowInvalid: Parquet magic bytes not found", no file named
    write_jsonl(tmp_path / "good.jsonl", make_rows(1))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match=r"sub/broken.parquet: cannot read it as Parquet"):
        list(iter_local(tmp_path))


@pytest.mark.parametrize(
    "source", ["mydata/rows.jsonl", "./rows", "../x", "~/data", "a/b/c", "rows.parquet", "x.json"]
)
def test_a_missing_path_is_no_such_file_not_a_hub_lookup(source, tmp_path, monkeypatch):
    # issue #17: on main "mydata/rows.jsonl" went to the hub (32 s of retries). Relative and
    # home paths resolve inside an empty folder, whatever the checkout's neighbours are
    # (a clone at /tmp/ci once had a sibling /tmp/x)
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(SourceError, match=f"{source}: no such file or directory"):
        describe_source(source)


def test_bundled_source_is_the_sample_directory():
    rows = [parse_row(r) for r in iter_source("bundled")]
    assert len(rows) == sum(1 for _ in iter_local(BUNDLED_DIR))
    assert rows and all(r.error is None for r in rows)


def test_s3_prefix_against_a_real_s3_compatible_server(datasets_bucket):
    client = datasets_bucket
    body = "\n".join(json.dumps(r) for r in make_rows(1))
    client.put_object(Bucket="datasets", Key="mt/part-1.jsonl", Body=body.encode())
    client.put_object(Bucket="datasets", Key="mt/readme.md", Body=b"not data")
    client.put_object(Bucket="datasets", Key="other/x.jsonl", Body=b"{}")
    rows = [parse_row(r) for r in iter_source("s3://datasets/mt/")]
    assert [r.data for r in rows] == make_rows(1)
    assert rows[0].origin == "mt/part-1.jsonl:1"
    with pytest.raises(SourceError, match="no .jsonl"):
        list(iter_source("s3://datasets/missing/"))


class TamperedBodies:
    """A real boto3 client whose object reads come back tampered (``tamper(bytes) -> bytes``),
    like a connection that ends early or flips a byte; every other call reaches the server."""

    def __init__(self, client, tamper):
        self._client, self._tamper = client, tamper

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_object(self, **kwargs):
        response = self._client.get_object(**kwargs)
        return {**response, "Body": io.BytesIO(self._tamper(response["Body"].read()))}


def test_a_short_or_corrupted_s3_download_is_detected(tmp_path, monkeypatch):
    # before core.storage, data prep's S3 reads (boto3's download_file) checked nothing: a
    # short or corrupted object was read as the dataset
    boto3 = pytest.importorskip("boto3")
    from core.storage import IntegrityError, upload_file

    downloads = tmp_path / "tmp"  # where iter_s3 downloads to (tempfile.mkdtemp)
    downloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(downloads))
    body = "\n".join(json.dumps(r) for r in make_rows(3)).encode()
    (tmp_path / "rows.jsonl").write_bytes(body)
    with moto_s3_server() as endpoint:
        for key, value in s3_env(endpoint).items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="datasets")
        # as `aws s3 cp` leaves it: no sha256 metadata, so the size is what is checked
        s3.put_object(Bucket="datasets", Key="plain/rows.jsonl", Body=body)
        # as core.storage.upload_file leaves it: sha256 metadata, so the content is checked too
        upload_file(tmp_path / "rows.jsonl", "s3://datasets/verified/rows.jsonl")
        for prefix in ("plain", "verified"):
            rows = [parse_row(r) for r in iter_s3(f"s3://datasets/{prefix}/", client=s3)]
            assert [r.data for r in rows] == make_rows(3)

        short = TamperedBodies(s3, lambda data: data[: len(data) // 2])
        with pytest.raises(IntegrityError, match=f"downloaded {len(body) // 2} bytes"):
            list(iter_s3("s3://datasets/plain/", client=short))
        flipped = TamperedBodies(s3, lambda data: data[:-2] + b"X" + data[-1:])  # same size
        with pytest.raises(IntegrityError, match="SHA-256"):
            list(iter_s3("s3://datasets/verified/", client=flipped))
    assert list(downloads.iterdir()) == []  # nothing half-downloaded is left behind


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_byte_order_mark_does_not_cost_the_first_row(tmp_path, suffix):
    # issue #32 item 9: on main the BOM made row 1 invalid JSON (quarantined); a .json array
    # with a BOM was read as JSON Lines, every line broken
    rows = [make_row(), make_row("German")]
    path = tmp_path / f"rows{suffix}"
    text = json.dumps(rows) if suffix == ".json" else "\n".join(map(json.dumps, rows)) + "\n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    read = _read(path)
    assert [r.error for r in read] == [None, None]
    assert [r.data for r in read] == rows


def test_a_url_source_is_named_as_unsupported_not_looked_for_on_disk():
    # the pre-check said "no such file or directory (looked for <cwd>/https:/host/rows.jsonl)"
    from data_prep.sources import SourceError, describe_source

    with pytest.raises(SourceError, match="is not an existing file or directory, an s3:// URI"):
        describe_source("https://data.example/rows.jsonl")
