"""Object storage (S3 and S3-compatible stores) for checkpoints and other step outputs.

Uploads are verified (per-part Content-MD5, then the final ETag) and a failed multipart upload
is aborted, so no partial object is left. A directory upload ends with a manifest object
(``_lingo_manifest.json``: key, size and SHA-256 of every file) written last: a prefix without
one is an incomplete upload. Downloads are resumable (ranged GETs into ``<path>.partial``,
guarded by the object's ETag), checked for size and SHA-256, and renamed into place only when
complete.

Every function uses ``boto3.client("s3")`` unless given a client, so ``AWS_ENDPOINT_URL`` and
the usual AWS credential chain apply. See ``docs/storage.md``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from core.atomic import atomic_write_text, open_no_follow

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MIN_PART_SIZE = 5 * MIB  # S3's minimum size for every part but the last
MAX_PARTS = 10_000  # S3's maximum number of parts in one multipart upload
DEFAULT_PART_SIZE = 8 * MIB
DEFAULT_THRESHOLD = 16 * MIB
MANIFEST_NAME = "_lingo_manifest.json"
SHA256_METADATA_KEY = "sha256"  # object metadata (x-amz-meta-sha256) set by our uploads
_CHUNK = 1 * MIB

S3Client = Any  # a boto3 S3 client; typed loosely so boto3 stays an import-time-free dependency


NO_CREDENTIALS = (
    "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in the pipeline they "
    "come from the optional Secret lingo-s3, which `lingo cluster setup` creates from them)"
)
"""What a step that reads or writes S3 without credentials says (the platform's Secrets are
optional: ``pipelines.platform.DEFAULT_SECRETS``)."""


class StorageError(RuntimeError):
    """An object-storage operation failed; the message names the URI and the cause."""


class IntegrityError(StorageError):
    """Data read or written does not match its expected size, MD5/ETag or SHA-256."""


class NoManifestError(StorageError):
    """The prefix has no manifest: an incomplete ``upload_dir``, or not written by it."""


def _list_prefix(client: S3Client, bucket: str, prefix: str, uri_prefix: str) -> list[dict]:
    """Manifest-like entries (``sha256`` None) for every object under the prefix."""
    entries = []
    with s3_errors(uri_prefix, "list objects"):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                rel = item["Key"][len(prefix) :]
                if not rel or rel.endswith("/"):
                    continue  # the prefix itself, or a "directory" marker
                if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
                    raise StorageError(f"{uri_prefix}: unsafe object key {item['Key']!r}")
                entries.append({"key": rel, "size": item["Size"], "sha256": None})
    return entries


@dataclass(frozen=True)
class UploadedObject:
    """What :func:`upload_file` wrote: the object, its size, SHA-256 and (unquoted) ETag."""

    uri: str
    size: int
    sha256: str
    etag: str


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/key`` into ``("bucket", "some/key")``.

    The key may be empty (``s3://bucket`` or ``s3://bucket/``), which names the whole bucket
    as a prefix.

    Raises:
        ValueError: the URI does not start with ``s3://`` or has no bucket.
    """
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r}: not an S3 URI; expected s3://bucket/key")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"{uri!r}: no bucket in S3 URI; expected s3://bucket/key")
    if any(c.isspace() for c in bucket):
        raise ValueError(f"{uri!r}: bucket name {bucket!r} contains whitespace")
    return bucket, key


def upload_file(
    path: str | os.PathLike[str],
    uri: str,
    *,
    part_size: int = DEFAULT_PART_SIZE,
    threshold: int = DEFAULT_THRESHOLD,
    client: S3Client | None = None,
) -> UploadedObject:
    """Upload one file to ``uri`` and verify what the store received.

    A file of at most ``threshold`` bytes is sent in one PUT with Content-MD5; a larger one as
    a multipart upload of ``part_size`` parts, each with Content-MD5, whose final ETag must be
    ``md5(concatenated part MD5s)-N``. On any failure the multipart upload is aborted (and an
    object whose ETag does not match is deleted), so no partial object is left. The file's
    SHA-256 is stored as object metadata ``sha256`` for :func:`download_file` to check.

    Args:
        path: Local file to upload.
        uri: Destination ``s3://bucket/key`` (a key, not a prefix ending in ``/``).
        part_size: Bytes per part of a multipart upload (at least 5 MiB, at most 10,000 parts).
        threshold: Files larger than this use a multipart upload.
        client: boto3 S3 client; ``boto3.client("s3")`` when omitted.

    Returns:
        The uploaded object's URI, size, SHA-256 and ETag.

    Raises:
        ValueError: bad URI or ``part_size``.
        FileNotFoundError: ``path`` is not a file.
        StorageError: the store refused or the upload failed (nothing is left behind).
        IntegrityError: the store's ETag does not match the data sent.
    """
    bucket, key = _object_key(uri)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file to upload to {uri}")
    size = path.stat().st_size
    if part_size < MIN_PART_SIZE:
        raise ValueError(f"part_size={part_size} is below S3's minimum of {MIN_PART_SIZE} bytes")
    client = client or s3_client()
    sha256 = _file_sha256(path)
    with path.open("rb") as f:
        if size <= threshold:
            etag = _put_single(client, f, bucket, key, uri, sha256)
        else:
            parts = -(-size // part_size)
            if parts > MAX_PARTS:
                raise ValueError(
                    f"{path}: {size} bytes in parts of {part_size} is {parts} parts, over S3's "
                    f"limit of {MAX_PARTS}; raise part_size"
                )
            etag = _put_multipart(client, f, bucket, key, uri, sha256, part_size)
    log.info("uploaded %s (%d bytes) to %s", path, size, uri)
    return UploadedObject(uri=uri, size=size, sha256=sha256, etag=etag)


def upload_dir(
    local_dir: str | os.PathLike[str],
    uri_prefix: str,
    *,
    part_size: int = DEFAULT_PART_SIZE,
    threshold: int = DEFAULT_THRESHOLD,
    client: S3Client | None = None,
) -> dict[str, Any]:
    """Upload every file under ``local_dir`` to ``uri_prefix``, then write the manifest last.

    Keys are the files' paths relative to ``local_dir``. Any manifest already at the prefix is
    deleted first, so during the upload the prefix reads as incomplete.

    Args:
        local_dir: Directory to upload (recursively; symlinks to files are followed).
        uri_prefix: Destination ``s3://bucket/prefix`` (a trailing ``/`` is optional).
        part_size: See :func:`upload_file`.
        threshold: See :func:`upload_file`.
        client: boto3 S3 client; ``boto3.client("s3")`` when omitted.

    Returns:
        The manifest: ``{"version": 1, "files": [{"key", "size", "sha256"}, ...]}``.

    Raises:
        NotADirectoryError: ``local_dir`` is not a directory.
        StorageError: an upload failed, or ``local_dir`` holds a file named like the manifest.
    """
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise NotADirectoryError(f"{local_dir}: not a directory to upload to {uri_prefix}")
    bucket, prefix = _prefix_key(uri_prefix)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    if (local_dir / MANIFEST_NAME) in files:
        raise StorageError(f"{local_dir}: holds a file named {MANIFEST_NAME}, which is reserved")
    client = client or s3_client()
    manifest_key = prefix + MANIFEST_NAME
    with s3_errors(f"s3://{bucket}/{manifest_key}", "delete stale manifest"):
        client.delete_object(Bucket=bucket, Key=manifest_key)
    entries = []
    for file in files:
        rel = file.relative_to(local_dir).as_posix()
        done = upload_file(
            file,
            f"s3://{bucket}/{prefix}{rel}",
            part_size=part_size,
            threshold=threshold,
            client=client,
        )
        entries.append({"key": rel, "size": done.size, "sha256": done.sha256})
    manifest = {"version": 1, "files": entries}
    body = json.dumps(manifest, indent=1).encode()
    manifest_uri = f"s3://{bucket}/{manifest_key}"
    with s3_errors(manifest_uri, "write manifest"):
        response = client.put_object(
            Bucket=bucket,
            Key=manifest_key,
            Body=body,
            ContentMD5=_b64(hashlib.md5(body, usedforsecurity=False).digest()),
            ContentType="application/json",
        )
    _check_etag(response, hashlib.md5(body, usedforsecurity=False).hexdigest(), manifest_uri)
    log.info("uploaded %d files from %s to %s", len(entries), local_dir, uri_prefix)
    return manifest


def download_file(
    uri: str,
    path: str | os.PathLike[str],
    *,
    expected_sha256: str | None = None,
    client: S3Client | None = None,
) -> Path:
    """Download ``uri`` to ``path``, resuming an earlier interrupted download.

    Bytes go to ``<path>.partial`` by ranged GETs; the object's ETag is kept in
    ``<path>.partial.etag``. A later call resumes from the partial file's size when the ETag is
    unchanged and starts over otherwise. The result is checked against the object's size and
    SHA-256 (``expected_sha256``, else the ``sha256`` metadata written by :func:`upload_file`,
    else size only) and renamed to ``path`` only when complete.

    Args:
        uri: Source ``s3://bucket/key``.
        path: Local destination file; its parent directories are created.
        expected_sha256: SHA-256 the content must have (e.g. from a manifest).
        client: boto3 S3 client; ``boto3.client("s3")`` when omitted.

    Returns:
        ``path``.

    Raises:
        StorageError: the object is missing or the transfer failed (the partial file is kept
            for a later resume).
        IntegrityError: size or SHA-256 mismatch (the partial file is deleted).
    """
    bucket, key = _object_key(uri)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    etag_file = path.with_name(path.name + ".partial.etag")
    client = client or s3_client()
    with s3_errors(uri, "head object"):
        head = client.head_object(Bucket=bucket, Key=key)
    etag, size = head["ETag"], head["ContentLength"]
    expected_sha256 = expected_sha256 or head.get("Metadata", {}).get(SHA256_METADATA_KEY)

    offset = 0
    if partial.exists() and etag_file.exists() and etag_file.read_text() == etag:
        offset = partial.stat().st_size
    if offset > size:
        offset = 0
    if offset == 0:
        partial.unlink(missing_ok=True)
        atomic_write_text(etag_file, etag)
    else:
        log.info("resuming %s at byte %d of %d", uri, offset, size)
    if offset < size:
        with s3_errors(uri, f"read bytes {offset}-"):
            response = client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={offset}-", IfMatch=etag
            )
            with open_no_follow(partial, "ab") as out:  # never through a planted link
                for chunk in iter(lambda: response["Body"].read(_CHUNK), b""):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
    partial.touch()  # an empty object has nothing to fetch

    got = partial.stat().st_size
    if got != size:
        _discard(partial, etag_file)
        raise IntegrityError(f"{uri}: downloaded {got} bytes, the object has {size}")
    if expected_sha256:
        actual = _file_sha256(partial)
        if actual != expected_sha256:
            _discard(partial, etag_file)
            raise IntegrityError(
                f"{uri}: SHA-256 {actual} does not match the expected {expected_sha256}; "
                "the object changed since it was recorded, or was corrupted"
            )
    os.replace(partial, path)
    etag_file.unlink(missing_ok=True)
    log.info("downloaded %s (%d bytes) to %s", uri, size, path)
    return path


def download_dir(
    uri_prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    client: S3Client | None = None,
    require_manifest: bool = True,
) -> Path:
    """Download a prefix written by :func:`upload_dir` into ``local_dir``, all or nothing.

    With ``require_manifest=False`` a prefix without a manifest (a copy made with
    ``aws s3 sync``, say) is listed instead and each object is checked against its listed size
    and its ``sha256`` metadata when it has one.

    Files are fetched into ``<local_dir>.partial/`` (kept across failures, so a rerun resumes)
    and each is checked against the manifest's size and SHA-256; the directory is renamed to
    ``local_dir`` only when every file is present and verified.

    Args:
        uri_prefix: Source ``s3://bucket/prefix``.
        local_dir: Destination directory; must not exist or be empty.
        client: boto3 S3 client; ``boto3.client("s3")`` when omitted.

    Returns:
        ``local_dir``.

    Raises:
        StorageError: no manifest at the prefix (an incomplete upload), a bad manifest,
            ``local_dir`` is not empty, or a transfer failed.
        IntegrityError: a file does not match the manifest.
    """
    local_dir = Path(local_dir)
    if local_dir.exists() and (not local_dir.is_dir() or any(local_dir.iterdir())):
        raise StorageError(f"{local_dir}: exists and is not an empty directory; remove it first")
    bucket, prefix = _prefix_key(uri_prefix)
    client = client or s3_client()
    try:
        manifest = _read_manifest(client, bucket, prefix, uri_prefix)
    except NoManifestError:
        if require_manifest:
            raise
        manifest = {"files": _list_prefix(client, bucket, prefix, uri_prefix)}
        if not manifest["files"]:
            raise StorageError(f"{uri_prefix}: no objects under this prefix") from None
    staging = local_dir.with_name(local_dir.name + ".partial")
    for entry in manifest["files"]:
        target = staging / entry["key"]
        if _matches(target, entry["size"], entry["sha256"]):
            continue  # fetched by an earlier, interrupted call
        download_file(
            f"s3://{bucket}/{prefix}{entry['key']}",
            target,
            expected_sha256=entry["sha256"],
            client=client,
        )
    staging.mkdir(parents=True, exist_ok=True)  # an empty manifest still makes a directory
    if local_dir.exists():
        local_dir.rmdir()
    os.replace(staging, local_dir)
    log.info("downloaded %d files from %s to %s", len(manifest["files"]), uri_prefix, local_dir)
    return local_dir


def list_objects(uri: str, *, client: S3Client | None = None) -> list[str]:
    """The keys of the objects whose key starts with the URI's key, as S3 matches a prefix
    (``s3://bucket/data`` lists ``data/a.jsonl`` and ``data.jsonl``), sorted.

    "Directory" markers (keys ending in ``/``) are left out.

    Args:
        uri: ``s3://bucket/prefix`` (an empty prefix lists the whole bucket).
        client: boto3 S3 client; :func:`s3_client` when omitted.

    Raises:
        StorageError: the listing failed, or a key would escape a local directory it is
            downloaded into (``..`` or absolute).
    """
    bucket, prefix = parse_s3_uri(uri)
    client = client or s3_client()
    keys = []
    with s3_errors(uri, "list objects"):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                key = item["Key"]
                if key.endswith("/"):
                    continue
                if PurePosixPath(key).is_absolute() or ".." in PurePosixPath(key).parts:
                    raise StorageError(f"{uri}: unsafe object key {key!r}")
                keys.append(key)
    return sorted(keys)


def s3_client() -> S3Client:
    """``boto3.client("s3")``, sending checksums only where S3 requires them: the client every
    function here uses unless given one.

    We send Content-MD5 ourselves; botocore's default extra CRC32 checksums are refused by
    some S3-compatible stores. Each client comes from a session of its own, so credentials
    and endpoint are read from the environment as it is now (boto3's default session keeps
    the credentials it first found: a Secret mapped in later, or one removed, went unseen).
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - boto3 is a core dependency
        raise ImportError("object storage needs boto3: pip install boto3") from exc
    session = boto3.session.Session()
    return session.client("s3", config=Config(request_checksum_calculation="when_required"))


def _object_key(uri: str) -> tuple[str, str]:
    bucket, key = parse_s3_uri(uri)
    if not key or key.endswith("/"):
        raise ValueError(f"{uri!r}: names a prefix, not an object; expected s3://bucket/key")
    return bucket, key


def _prefix_key(uri_prefix: str) -> tuple[str, str]:
    """Bucket and prefix, the prefix empty or ending in ``/``."""
    bucket, prefix = parse_s3_uri(uri_prefix)
    return bucket, (prefix.rstrip("/") + "/" if prefix.strip("/") else "")


def _put_single(client: S3Client, f: BinaryIO, bucket: str, key: str, uri: str, sha256: str) -> str:
    body = f.read()
    md5 = hashlib.md5(body, usedforsecurity=False)
    with s3_errors(uri, "put object"):
        response = client.put_object(
            Bucket=bucket,
            Key=key,
            Body=body,
            ContentMD5=_b64(md5.digest()),
            Metadata={SHA256_METADATA_KEY: sha256},
        )
    return _check_etag(response, md5.hexdigest(), uri)


def _put_multipart(
    client: S3Client, f: BinaryIO, bucket: str, key: str, uri: str, sha256: str, part_size: int
) -> str:
    with s3_errors(uri, "start multipart upload"):
        upload_id = client.create_multipart_upload(
            Bucket=bucket, Key=key, Metadata={SHA256_METADATA_KEY: sha256}
        )["UploadId"]
    completed = False
    try:
        digests: list[bytes] = []
        parts = []
        for number, data in enumerate(iter(lambda: f.read(part_size), b""), start=1):
            md5 = hashlib.md5(data, usedforsecurity=False)
            with s3_errors(uri, f"upload part {number}"):
                response = client.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ContentMD5=_b64(md5.digest()),
                )
            etag = _check_etag(response, md5.hexdigest(), f"{uri} part {number}")
            digests.append(md5.digest())
            parts.append({"PartNumber": number, "ETag": f'"{etag}"'})
        with s3_errors(uri, "complete multipart upload"):
            response = client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        completed = True
        combined = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
        return _check_etag(response, f"{combined}-{len(parts)}", uri)
    except BaseException:
        try:
            if completed:  # the object exists but does not match what we sent
                client.delete_object(Bucket=bucket, Key=key)
            else:
                log.warning("aborting multipart upload %s of %s", upload_id, uri)
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:
            log.exception("cleanup of failed upload %s to %s failed too", upload_id, uri)
        raise


def _read_manifest(client: S3Client, bucket: str, prefix: str, uri_prefix: str) -> dict[str, Any]:
    from botocore.exceptions import ClientError

    manifest_uri = f"s3://{bucket}/{prefix}{MANIFEST_NAME}"
    try:
        body = client.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            raise NoManifestError(
                f"{uri_prefix}: incomplete upload: no {MANIFEST_NAME} at {manifest_uri} "
                "(upload_dir writes it last; rerun the upload)"
            ) from exc
        raise StorageError(f"{manifest_uri}: cannot read manifest: {exc}") from exc
    try:
        manifest = json.loads(body)
        files = manifest["files"]
        for entry in files:
            rel = PurePosixPath(entry["key"])
            malformed = not isinstance(entry["size"], int) or not isinstance(entry["sha256"], str)
            if rel.is_absolute() or ".." in rel.parts or malformed:
                raise ValueError(f"unsafe or malformed entry {entry!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise StorageError(f"{manifest_uri}: malformed manifest: {exc}") from exc
    return manifest


@contextmanager
def s3_errors(uri: str, action: str) -> Iterator[None]:
    """Re-raise boto3/botocore errors as :class:`StorageError` naming ``uri`` and ``action``
    (no credentials at all: naming where they come from)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        yield
    except NoCredentialsError as exc:
        raise StorageError(f"{uri}: {action} failed: {NO_CREDENTIALS}") from exc
    except (BotoCoreError, ClientError) as exc:
        raise StorageError(f"{uri}: {action} failed: {exc}") from exc


def _check_etag(response: dict[str, Any], expected: str, what: str) -> str:
    etag = response["ETag"].strip('"')
    if etag != expected:
        raise IntegrityError(f"{what}: store returned ETag {etag}, expected {expected}")
    return etag


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _matches(path: Path, size: int, sha256: str | None) -> bool:
    if not (path.is_file() and path.stat().st_size == size):
        return False
    return sha256 is None or _file_sha256(path) == sha256


def _discard(*paths: Path) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


__all__ = [
    "IntegrityError",
    "MANIFEST_NAME",
    "StorageError",
    "UploadedObject",
    "download_dir",
    "download_file",
    "list_objects",
    "parse_s3_uri",
    "s3_client",
    "upload_dir",
    "upload_file",
]
