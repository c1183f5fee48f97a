"""The data fingerprint: one SHA-256 over what data prep read and the settings that shape it.

A scheduled run compares it with the champion's (``lingo.data_fingerprint``, a version tag)
and ends early as ``unchanged data`` when they are equal (``eval.gate.check_data``). What goes
in, per source (``DataPrepConfig.source`` and each question set's):

* a local file or directory, and the bundled sample: every data file's relative path, size
  and SHA-256 of its bytes;
* ``s3://bucket/prefix``: every data object's key, ``ETag`` and size, as listed (an ETag
  changes when the object's bytes do, multipart uploads included);
* a hub dataset id: the dataset's revision (the commit sha ``huggingface_hub`` reports) and
  the split. When the revision cannot be looked up (offline, no cache entry naming it), the
  fingerprint is ``unknown``: never equal to anything, so the run retrains;
* every ``DataPrepConfig`` field but ``workers`` (which shapes nothing) and the sources' names
  (the same bytes read from another folder or bucket are the same data): the split fraction
  and seed, the validation limits, the answer-language policy, augmentation, question sets.

The fingerprint is computed before the rows are read; a source changed while data prep reads
it gives a fingerprint of the earlier state (the next run sees the change).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.hub import HUB_LOOKUP_TIMEOUT_S
from data_prep.config import BUNDLED_SOURCE, DataPrepConfig

log = logging.getLogger(__name__)

UNKNOWN = "unknown"
"""The fingerprint of a source whose state cannot be pinned (a hub revision not looked up)."""
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DataFingerprint:
    """What data prep read, pinned.

    Attributes:
        sha256: SHA-256 of ``inputs`` (canonical JSON), or ``unknown``.
        inputs: What it is computed from: per source its files, objects or hub revision, and
            the config (the dataset card and the MLflow run record it).
    """

    sha256: str
    inputs: dict[str, Any]

    @property
    def known(self) -> bool:
        """Whether the fingerprint pins the data (else the run always retrains)."""
        return self.sha256 != UNKNOWN

    def short(self) -> str:
        """The first 12 hex digits (or ``unknown``), for one-line messages."""
        return self.sha256[:12]


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _local_state(path: Path) -> dict[str, Any]:
    from data_prep.sources import list_data_files

    files = list_data_files(path)
    return {
        "kind": "local",
        "files": [
            {
                "path": file.name if path.is_file() else file.relative_to(path).as_posix(),
                "size": file.stat().st_size,
                "sha256": file_sha256(file),
            }
            for file in files
        ],
    }


def _s3_state(uri: str, client=None) -> dict[str, Any]:
    from core.storage import s3_client, s3_errors
    from data_prep.sources import SUPPORTED_SUFFIXES, split_s3_uri

    bucket, prefix = split_s3_uri(uri)
    client = client or s3_client()
    objects = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    with s3_errors(uri, "list objects"):  # a StorageError naming the URI, not a traceback
        for page in pages:
            for item in page.get("Contents", []):
                if item["Key"].endswith(SUPPORTED_SUFFIXES):
                    etag = item["ETag"].strip('"')
                    objects.append({"key": item["Key"], "etag": etag, "size": item["Size"]})
    return {"kind": "s3", "objects": sorted(objects, key=lambda o: o["key"])}


def hub_revision(dataset_id: str) -> str | None:
    """The commit sha of ``dataset_id`` on the hub, or ``None`` when it cannot be looked up
    (one request, ``HUB_LOOKUP_TIMEOUT_S``)."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(dataset_id, timeout=HUB_LOOKUP_TIMEOUT_S).sha
    except Exception as exc:  # httpx's network errors, 5xx, offline mode, not an id: the
        # source's own reading says which (data_prep.sources: one bounded look-up)
        log.warning("%s: no hub revision (%s); the data fingerprint is unknown", dataset_id, exc)
        return None


def source_state(source: str, split: str = "train", s3=None) -> dict[str, Any]:
    """What one source holds now (see the module docstring); ``revision: None`` for a hub
    dataset whose revision cannot be looked up."""
    from data_prep.sources import BUNDLED_DIR, describe_source

    kind = describe_source(source)
    if kind == "bundled":
        return _local_state(BUNDLED_DIR) | {"kind": BUNDLED_SOURCE}
    if kind == "local":
        return _local_state(Path(source))
    if kind == "s3":
        return _s3_state(source, s3)
    return {"kind": "hub", "id": source, "split": split, "revision": hub_revision(source)}


def data_fingerprint(config: DataPrepConfig, s3=None) -> DataFingerprint:
    """The fingerprint of ``config``'s sources and settings (see the module docstring).

    Raises:
        SourceError: a source cannot be read.
    """
    sources = [source_state(config.source, config.hub_split, s3)]
    sources += [source_state(q.source, q.split, s3) for q in config.question_sets]
    settings = config.model_dump(mode="json", exclude={"workers", "source"})
    for question_set in settings["question_sets"]:  # where the data lives is not the data
        del question_set["source"]
    inputs = {"sources": sources, "config": settings}
    if any(s["kind"] == "hub" and s["revision"] is None for s in sources):
        return DataFingerprint(UNKNOWN, inputs)
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return DataFingerprint(hashlib.sha256(text.encode()).hexdigest(), inputs)
