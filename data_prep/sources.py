"""Stream raw rows from wherever the dataset lives: the bundled sample, a hub id, local files, S3.

Every row comes out as a :class:`RawRow` that remembers where it came from (file and line,
or hub split and index) so that validation errors can name it. Rows that cannot even be parsed
(a broken JSON line) still come out, with ``error`` set, so they reach the quarantine file
instead of being lost.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from core.atomic import IO_BUFFER
from core.hub import HubLookupError, find_on_hub, looks_like_path
from core.storage import S3Client, download_file, list_objects, parse_s3_uri, s3_client
from data_prep.config import BUNDLED_SOURCE

log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parent / "sample"
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
UTF8_BOM = b"\xef\xbb\xbf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceError(ValueError):
    """The dataset source cannot be read (missing path, no data files, unknown scheme)."""


class RawRow(NamedTuple):
    """One input row, as read (a named tuple: cheap to build, once per row).

    Attributes:
        index: 0-based position in the whole stream (the "row number" reported to users).
        origin: where it came from, e.g. ``train.jsonl:17`` or ``hub:org/name[train][16]``.
        data: the parsed value (normally a dict); None when it could not be parsed.
        error: why it could not be parsed, else None.
        raw_text: the unparsed text when parsing failed, so nothing is lost.
        line: for JSON Lines, the undecoded line; ``parse_row`` decodes it (late, so that
            decoding can happen in a worker process).
    """

    index: int
    origin: str
    data: Any = None
    error: str | None = None
    raw_text: str | None = None
    line: bytes | None = None


def parse_row(raw: RawRow) -> RawRow:
    """Decode a row read as an undecoded JSON line; other rows are returned as they are."""
    if raw.line is None:
        return raw
    try:
        return RawRow(raw.index, raw.origin, data=orjson.loads(raw.line))
    except orjson.JSONDecodeError as exc:
        text = raw.line.rstrip(b"\r\n").decode("utf-8", errors="backslashreplace")
        return RawRow(raw.index, raw.origin, error=f"invalid JSON: {exc}", raw_text=text)


def describe_source(source: str) -> str:
    """What kind of source a string names: bundled, local, s3 or hub."""
    if source == BUNDLED_SOURCE:
        return "bundled"
    if source.startswith("s3://"):
        return "s3"
    if Path(source).exists():
        return "local"
    if looks_like_path(source):
        raise SourceError(
            f"{source}: no such file or directory (looked for {Path(source).absolute()})"
        )
    if _HUB_ID.match(source):
        return "hub"
    raise SourceError(
        f"dataset source {source!r} is not an existing file or directory, an s3:// URI, "
        f"a hub dataset id like 'HuggingFaceH4/Multilingual-Thinking', or {BUNDLED_SOURCE!r}"
    )


def iter_source(source: str, hub_split: str = "train") -> Iterator[RawRow]:
    """Yield every row of ``source`` in a stable order (see DataPrepConfig.source)."""
    kind = describe_source(source)
    if kind == "bundled":
        yield from iter_local(BUNDLED_DIR)
    elif kind == "local":
        yield from iter_local(Path(source))
    elif kind == "s3":
        yield from iter_s3(source)
    else:
        yield from _iter_hub(source, hub_split)


def list_data_files(path: Path) -> list[Path]:
    """The data files under ``path`` (itself if a file), sorted by relative path."""
    if path.is_file():
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise SourceError(f"{path}: unsupported file type; use one of {SUPPORTED_SUFFIXES}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
    if not files:
        raise SourceError(f"{path}: no {', '.join(SUPPORTED_SUFFIXES)} files in this directory")
    return files


def iter_local(path: Path, start_index: int = 0) -> Iterator[RawRow]:
    """Rows of a local file or of every data file under a directory."""
    index = start_index
    for file in list_data_files(path):
        name = file.name if path.is_file() else str(file.relative_to(path))
        reader = _iter_parquet if file.suffix == ".parquet" else _iter_json_file
        for origin, data, line in reader(file, name):
            yield RawRow(index, origin, data=data, line=line)
            index += 1


def _iter_json_file(file: Path, name: str) -> Iterator[tuple[str, Any, bytes | None]]:
    """(origin, data, None) for a JSON array file; (origin, None, line) for JSON Lines.

    A UTF-8 byte-order mark (editors on Windows write one) is skipped, not read as part of
    the first row."""
    with file.open("rb", buffering=IO_BUFFER) as fh:
        _check_encoding(file, fh.read(4))
        fh.seek(0)
        start = len(UTF8_BOM) if fh.read(len(UTF8_BOM)) == UTF8_BOM else 0
        fh.seek(start)
        head = fh.read(4096).lstrip()
        fh.seek(start)
        if file.suffix == ".json" and head.startswith(b"["):
            try:
                rows = orjson.loads(fh.read())
            except orjson.JSONDecodeError as exc:
                raise SourceError(f"{file}: not valid JSON ({exc})") from exc
            for i, row in enumerate(rows):
                yield f"{name}[{i}]", row, None
            return
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                yield f"{name}:{line_no}", None, line


_NOT_UTF8 = (
    (b"\x1f\x8b", "gzip-compressed; decompress it first (gunzip)"),
    (b"\xff\xfe\x00\x00", "UTF-32 text; save it as UTF-8"),
    (b"\x00\x00\xfe\xff", "UTF-32 text; save it as UTF-8"),
    (b"\xff\xfe", "UTF-16 text; save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text; save it as UTF-8"),
)
"""The first bytes of files that are no JSON text (a gzip stream, a UTF-16/32 byte-order
mark): refused whole, with one line, rather than every row quarantined as invalid JSON."""


def _check_encoding(file: Path, head: bytes) -> None:
    for magic, what in _NOT_UTF8:
        if head.startswith(magic):
            raise SourceError(f"{file}: the file is {what}")


def _iter_parquet(file: Path, name: str) -> Iterator[tuple[str, Any, bytes | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        batches = pq.ParquetFile(file).iter_batches(batch_size=2048)
        for batch in batches:
            for data in batch.to_pylist():
                yield f"{name}[{row}]", data, None
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{file}: cannot read it as Parquet after {row} rows ({exc})") from exc


def _iter_hub(dataset_id: str, split: str) -> Iterator[RawRow]:
    """Stream a dataset from the Hugging Face hub (needs network or a local HF cache); one
    bounded look-up first (``core.hub.find_on_hub``), not half a minute of retries."""
    try:
        find_on_hub(dataset_id, "dataset")
    except HubLookupError as exc:
        raise SourceError(
            f"{dataset_id}: not a local file or directory (looked for "
            f"{Path(dataset_id).absolute()}), and {exc}"
        ) from None
    from datasets import load_dataset

    log.info("loading %s split %s from the hub", dataset_id, split)
    dataset = load_dataset(dataset_id, split=split, streaming=True)
    for index, data in enumerate(dataset):
        yield RawRow(index, f"hub:{dataset_id}[{split}][{index}]", dict(data))


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` → ``("bucket", "some/key")`` (``core.storage.parse_s3_uri``)."""
    try:
        return parse_s3_uri(uri)
    except ValueError as exc:
        raise SourceError(f"{exc} (a data source: s3://bucket/key-or-prefix)") from exc


def iter_s3(uri: str, client: S3Client | None = None) -> Iterator[RawRow]:
    """Download an S3 object or every data file under a prefix, then read it locally.

    Each object goes through ``core.storage.download_file``: resumable ranged reads, checked
    against the object's size and, when it carries one (an upload by ``core.storage``), its
    SHA-256 metadata; a short or corrupted download raises ``IntegrityError`` before any row
    is read. Honors ``AWS_ENDPOINT_URL`` (S3-compatible stores) and the usual AWS credential
    chain.

    Args:
        uri: ``s3://bucket/key-or-prefix``.
        client: boto3 S3 client; ``core.storage.s3_client()`` when omitted.
    """
    bucket, _ = split_s3_uri(uri)
    client = client or s3_client()
    tmp = Path(tempfile.mkdtemp(prefix="lingo-s3-"))
    try:
        keys = [k for k in list_objects(uri, client=client) if k.endswith(SUPPORTED_SUFFIXES)]
        if not keys:
            raise SourceError(f"{uri}: no {', '.join(SUPPORTED_SUFFIXES)} objects under this URI")
        for key in keys:
            download_file(f"s3://{bucket}/{key}", tmp / key, client=client)
        yield from iter_local(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
