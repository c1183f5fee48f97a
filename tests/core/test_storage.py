"""core.storage against a real S3-compatible server (moto_server on 127.0.0.1).

Failures (a part upload or a download stream breaking) are injected by wrapping a real boto3
client: every call still reaches the real server except the one made to fail.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os

import boto3
import pytest
from hypothesis import given
from hypothesis import strategies as st
from s3_server import moto_s3_server, s3_env

from core.storage import (
    MANIFEST_NAME,
    MIB,
    IntegrityError,
    StorageError,
    download_dir,
    download_file,
    list_objects,
    parse_s3_uri,
    upload_dir,
    upload_file,
)

_bucket_numbers = itertools.count()


@pytest.fixture(scope="module")
def s3():
    """A boto3 client on one moto_server for the module, with the env set for default clients."""
    with moto_s3_server() as endpoint, pytest.MonkeyPatch.context() as mp:
        for key, value in s3_env(endpoint).items():
            mp.setenv(key, value)
        yield boto3.client("s3")


@pytest.fixture
def bucket(s3):
    name = f"test-{next(_bucket_numbers)}"
    s3.create_bucket(Bucket=name)
    return name


class WrappedClient:
    """A real client whose calls are recorded, and one of them optionally broken."""

    def __init__(self, client, fail=None):
        self._client = client
        self._fail = fail or (lambda name, kwargs: None)
        self.calls: list[tuple[str, dict]] = []

    def __getattr__(self, name):
        method = getattr(self._client, name)

        def call(**kwargs):
            self.calls.append((name, kwargs))
            self._fail(name, kwargs)
            return method(**kwargs)

        return call

    def kwargs_of(self, name):
        return [kwargs for called, kwargs in self.calls if called == name]


@given(
    bucket=st.from_regex(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", fullmatch=True),
    key=st.text(min_size=0, max_size=50),
)
def test_parse_s3_uri_splits_bucket_from_key(bucket, key):
    assert parse_s3_uri(f"s3://{bucket}/{key}") == (bucket, key)


@pytest.mark.parametrize(
    ("uri", "error"),
    [
        ("bucket/key", "not an S3 URI"),
        ("https://bucket/key", "not an S3 URI"),
        ("s3://", "no bucket"),
        ("s3:///key", "no bucket"),
        ("s3://my bucket/key", "whitespace"),
    ],
)
def test_parse_s3_uri_rejects_bad_uris(uri, error):
    with pytest.raises(ValueError, match=error):
        parse_s3_uri(uri)


def test_upload_file_rejects_a_prefix_and_a_small_part_size(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"x")
    with pytest.raises(ValueError, match="names a prefix"):
        upload_file(src, "s3://bucket/dir/")
    with pytest.raises(ValueError, match="part_size"):
        upload_file(src, "s3://bucket/key", part_size=MIB)


def test_list_objects_matches_the_key_prefix_as_s3_does(s3, bucket):
    for key in ("data/b.jsonl", "data/a.jsonl", "data/sub/", "data.jsonl", "other/x.jsonl"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    assert list_objects(f"s3://{bucket}/data") == ["data.jsonl", "data/a.jsonl", "data/b.jsonl"]
    assert list_objects(f"s3://{bucket}/data/") == ["data/a.jsonl", "data/b.jsonl"]
    assert list_objects(f"s3://{bucket}/none/") == []


def test_small_file_round_trip_with_single_put(s3, bucket, tmp_path):
    data = os.urandom(1000)
    (tmp_path / "small.bin").write_bytes(data)
    done = upload_file(tmp_path / "small.bin", f"s3://{bucket}/a/small.bin")

    head = s3.head_object(Bucket=bucket, Key="a/small.bin")
    assert done.etag == head["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    assert head["Metadata"]["sha256"] == done.sha256 == hashlib.sha256(data).hexdigest()
    out = download_file(f"s3://{bucket}/a/small.bin", tmp_path / "out" / "small.bin")
    assert out.read_bytes() == data
    assert sorted(p.name for p in out.parent.iterdir()) == ["small.bin"]


def test_multipart_round_trip_checks_the_composite_etag(s3, bucket, tmp_path):
    data = os.urandom(11 * MIB)
    (tmp_path / "big.bin").write_bytes(data)
    client = WrappedClient(s3)
    done = upload_file(
        tmp_path / "big.bin",
        f"s3://{bucket}/big.bin",
        part_size=5 * MIB,
        threshold=5 * MIB,
        client=client,
    )

    parts = client.kwargs_of("upload_part")
    assert [len(p["Body"]) for p in parts] == [5 * MIB, 5 * MIB, 1 * MIB]
    assert all(p["ContentMD5"] for p in parts)
    digests = b"".join(
        hashlib.md5(data[i : i + 5 * MIB]).digest() for i in range(0, len(data), 5 * MIB)
    )
    assert done.etag == f"{hashlib.md5(digests).hexdigest()}-3"
    assert s3.head_object(Bucket=bucket, Key="big.bin")["ETag"].strip('"') == done.etag
    assert download_file(f"s3://{bucket}/big.bin", tmp_path / "copy.bin").read_bytes() == data


def test_failed_part_aborts_the_upload_and_leaves_nothing(s3, bucket, tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(11 * MIB))

    def break_part_two(name, kwargs):
        if name == "upload_part" and kwargs["PartNumber"] == 2:
            raise ConnectionResetError("simulated network failure on part 2")

    client = WrappedClient(s3, fail=break_part_two)
    with pytest.raises(ConnectionResetError, match="part 2"):
        upload_file(
            tmp_path / "big.bin",
            f"s3://{bucket}/big.bin",
            part_size=5 * MIB,
            threshold=5 * MIB,
            client=client,
        )

    assert len(client.kwargs_of("abort_multipart_upload")) == 1
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []


def test_directory_round_trip_writes_the_manifest_last(s3, bucket, tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    files = {"config.json": b'{"a": 1}', "sub/weights.bin": os.urandom(6 * MIB), "empty": b""}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    client = WrappedClient(s3)
    manifest = upload_dir(
        src, f"s3://{bucket}/run/1", part_size=5 * MIB, threshold=5 * MIB, client=client
    )

    last_write = [
        k for name, k in client.calls if name in ("put_object", "complete_multipart_upload")
    ][-1]
    assert last_write["Key"] == f"run/1/{MANIFEST_NAME}"
    stored = json.loads(s3.get_object(Bucket=bucket, Key=f"run/1/{MANIFEST_NAME}")["Body"].read())
    assert stored == manifest
    assert {e["key"]: (e["size"], e["sha256"]) for e in stored["files"]} == {
        rel: (len(data), hashlib.sha256(data).hexdigest()) for rel, data in files.items()
    }

    out = download_dir(f"s3://{bucket}/run/1/", tmp_path / "restored")
    assert {
        p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()
    } == files
    assert not (tmp_path / "restored.partial").exists()


def test_download_dir_refuses_a_prefix_without_manifest(s3, bucket, tmp_path):
    s3.put_object(Bucket=bucket, Key="run/weights.bin", Body=b"half an upload")
    with pytest.raises(StorageError, match="incomplete upload"):
        download_dir(f"s3://{bucket}/run", tmp_path / "restored")
    assert not (tmp_path / "restored").exists()


def test_download_dir_detects_an_object_changed_after_the_manifest(s3, bucket, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"original weights")
    upload_dir(src, f"s3://{bucket}/run")
    # Overwritten with a valid upload of its own (new ETag and sha256 metadata): only the
    # manifest still records the original content.
    (tmp_path / "other.bin").write_bytes(b"tampered weights")
    upload_file(tmp_path / "other.bin", f"s3://{bucket}/run/weights.bin")

    with pytest.raises(IntegrityError, match="SHA-256"):
        download_dir(f"s3://{bucket}/run", tmp_path / "restored")
    assert not (tmp_path / "restored").exists()
    assert not (tmp_path / "restored.partial" / "weights.bin").exists()
    assert not (tmp_path / "restored.partial" / "weights.bin.partial").exists()


class BreakingBody:
    """A response body that fails after ``limit`` bytes, like a dropped connection."""

    def __init__(self, body, limit):
        self._body, self._left = body, limit

    def read(self, n):
        if self._left <= 0:
            raise ConnectionResetError("simulated dropped connection")
        chunk = self._body.read(min(n, self._left))
        self._left -= len(chunk)
        return chunk


def test_interrupted_download_resumes_from_the_partial_file(s3, bucket, tmp_path):
    data = os.urandom(3 * MIB)
    s3.put_object(Bucket=bucket, Key="w.bin", Body=data)
    target = tmp_path / "w.bin"

    class DroppingClient(WrappedClient):
        def get_object(self, **kwargs):
            response = s3.get_object(**kwargs)
            return {**response, "Body": BreakingBody(response["Body"], MIB)}

    with pytest.raises(ConnectionResetError):
        download_file(f"s3://{bucket}/w.bin", target, client=DroppingClient(s3))
    partial = tmp_path / "w.bin.partial"
    assert partial.read_bytes() == data[:MIB] and not target.exists()

    client = WrappedClient(s3)
    download_file(f"s3://{bucket}/w.bin", target, client=client)
    assert [k["Range"] for k in client.kwargs_of("get_object")] == [f"bytes={MIB}-"]
    assert target.read_bytes() == data
    assert not partial.exists() and not (tmp_path / "w.bin.partial.etag").exists()


def test_partial_file_of_a_changed_object_is_discarded(s3, bucket, tmp_path):
    data = os.urandom(2 * MIB)
    s3.put_object(Bucket=bucket, Key="w.bin", Body=data)
    (tmp_path / "w.bin.partial").write_bytes(b"\0" * MIB)  # from an older version of the object
    (tmp_path / "w.bin.partial.etag").write_text('"etag-of-the-older-version"')

    client = WrappedClient(s3)
    download_file(f"s3://{bucket}/w.bin", tmp_path / "w.bin", client=client)
    assert [k["Range"] for k in client.kwargs_of("get_object")] == ["bytes=0-"]
    assert (tmp_path / "w.bin").read_bytes() == data


def test_download_dir_lists_a_prefix_without_a_manifest_when_allowed(s3, bucket, tmp_path):
    """A model copied with `aws s3 sync` has no manifest: it is listed and size-checked."""
    for key, body in {"m/config.json": b"{}", "m/sub/w.bin": b"x" * 100}.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    with pytest.raises(StorageError, match="incomplete upload"):
        download_dir(f"s3://{bucket}/m/", tmp_path / "strict")
    out = download_dir(f"s3://{bucket}/m/", tmp_path / "listed", require_manifest=False)
    assert (out / "sub" / "w.bin").read_bytes() == b"x" * 100
    assert (out / "config.json").read_bytes() == b"{}"
    with pytest.raises(StorageError, match="no objects under this prefix"):
        download_dir(f"s3://{bucket}/empty/", tmp_path / "none", require_manifest=False)


def test_base_model_comes_from_s3(s3, bucket, tmp_path, tiny_model_dir):
    from trainer.base_model import materialize_base_model
    from trainer.tiny_model import TinyModelConfig

    upload_dir(tiny_model_dir, f"s3://{bucket}/models/tiny/")
    out = materialize_base_model(f"s3://{bucket}/models/tiny", tmp_path / "base", TinyModelConfig())
    for path in tiny_model_dir.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes()


def test_publish_uploads_the_model_and_the_eval_reports(s3, bucket, tmp_path, tiny_model_dir):
    from types import SimpleNamespace

    from components.tracking import publish

    results, report = tmp_path / "results.json", tmp_path / "report.md"
    results.write_text('{"models": []}')
    report.write_text("# eval\n")
    prefix = publish.python_func(
        grpo_model=SimpleNamespace(path=str(tiny_model_dir)),
        eval_results=SimpleNamespace(path=str(results)),
        eval_report=SimpleNamespace(path=str(report)),
        export_uri=f"s3://{bucket}/exports/",
        pipeline_run_id="run-7",
    )
    assert prefix == f"s3://{bucket}/exports/run-7"
    back = download_dir(f"{prefix}/grpo-model/", tmp_path / "back")
    assert sorted(p.name for p in back.iterdir()) == sorted(
        p.name for p in tiny_model_dir.iterdir()
    )
    body = s3.get_object(Bucket=bucket, Key="exports/run-7/eval/report.md")["Body"].read()
    assert body == b"# eval\n"


def test_no_credentials_names_the_secret_they_come_from(monkeypatch, tmp_path):
    """The platform's S3 Secret is optional: a step that reads S3 without it fails in one line
    naming the variables and the Secret (before: "Unable to locate credentials")."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached
    with pytest.raises(StorageError) as caught:
        list_objects("s3://bucket/prefix/")
    message = str(caught.value)
    assert "\n" not in message
    assert "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
    assert "Secret lingo-s3" in message
