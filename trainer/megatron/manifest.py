"""``lingo_manifest.json``: what a converted Megatron checkpoint was made from, and how.

Written next to the checkpoint by the convert step: the layout, the weights dtype, a sha256 of
the source HF directory (its ``*.safetensors`` files and ``config.json``, streamed), the
library versions and the creation time. Written atomically, read back and validated; a later
step calls ``check_manifest`` to make sure the checkpoint it is about to load is the one it
expects (same source model, same layout and dtype).
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.atomic import atomic_write_text
from trainer.megatron.layout import MegatronLayout

MANIFEST_FILE = "lingo_manifest.json"
MANIFEST_VERSION = 1
LIBRARIES = ("megatron-core", "megatron-bridge", "torch", "transformers")
"""Distributions whose versions the manifest records (``None`` when not installed)."""

# Fields of the layout that decide how the checkpoint is sharded and typed; the data-parallel
# size and the placement do not change what is written.
LAYOUT_FIELDS = ("tp", "pp", "ep", "etp", "cp", "vpp", "params_dtype")

_CHUNK = 1 << 20


class ManifestError(ValueError):
    """A manifest that is missing, unreadable or inconsistent."""


class ManifestMismatch(ValueError):
    """A checkpoint whose manifest does not match the requested source or layout."""


class MegatronManifest(BaseModel):
    """What ``lingo_manifest.json`` holds.

    Attributes:
        manifest_version: format of this file.
        checkpoint_format: Megatron checkpoint format (``torch_dist``).
        layout: the layout the checkpoint was converted for.
        dtype: the weights dtype (the layout's ``params_dtype``).
        world_size: the world size the layout was checked for (the training job's).
        source_dir: the HF directory converted (as given; may be a different mount later).
        source_sha256: sha256 over the source's ``config.json`` and ``*.safetensors``.
        source_files: the hashed files, in hashing order.
        library_versions: distribution → version (``None``: not installed).
        created_at: UTC time of writing, ISO 8601.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest_version: Literal[1] = MANIFEST_VERSION
    checkpoint_format: str = "torch_dist"
    layout: MegatronLayout
    dtype: Literal["bf16", "fp16", "fp32"]
    world_size: int = Field(ge=1)
    source_dir: str
    source_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    source_files: list[str] = Field(min_length=1)
    library_versions: dict[str, str | None]
    created_at: str

    @model_validator(mode="after")
    def _dtype_is_the_layouts(self) -> MegatronManifest:
        if self.dtype != self.layout.params_dtype:
            raise ValueError(
                f"dtype {self.dtype!r} differs from layout.params_dtype "
                f"{self.layout.params_dtype!r}"
            )
        return self


def hash_hf_directory(hf_dir: str | Path) -> tuple[str, list[str]]:
    """sha256 of a HF model directory's weights and config, streamed in 1 MiB chunks.

    The hash covers ``config.json`` and every top-level ``*.safetensors`` file in name order;
    each file contributes its name and size before its bytes, so renaming or truncating a
    shard changes the hash.

    Returns:
        The hex digest and the hashed file names.

    Raises:
        ManifestError: the directory lacks ``config.json`` or any ``*.safetensors`` file.
    """
    hf_dir = Path(hf_dir)
    weights = sorted(p.name for p in hf_dir.glob("*.safetensors") if p.is_file())
    if not (hf_dir / "config.json").is_file() or not weights:
        raise ManifestError(
            f"{hf_dir}: needs config.json and *.safetensors weights to hash "
            f"(found config.json: {(hf_dir / 'config.json').is_file()}, "
            f"safetensors files: {len(weights)})"
        )
    names = ["config.json", *weights]
    digest = hashlib.sha256()
    for name in names:
        path = hf_dir / name
        digest.update(name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest(), names


def library_versions(packages: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """Installed versions of ``packages`` (``None`` for those not installed)."""
    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def build_manifest(
    hf_dir: str | Path,
    layout: MegatronLayout,
    world_size: int = 1,
    source_sha256: str | None = None,
) -> MegatronManifest:
    """The manifest of a checkpoint converted from ``hf_dir`` with ``layout``.

    Args:
        hf_dir: the source HF directory.
        layout: the layout used for the conversion.
        world_size: the world size the layout was checked for.
        source_sha256: the source hash when already computed (skips hashing again).
    """
    digest, files = hash_hf_directory(hf_dir)
    if source_sha256 is not None and source_sha256 != digest:
        raise ManifestError(
            f"{hf_dir}: its hash {digest} differs from the given source_sha256 {source_sha256}; "
            "the source changed during conversion"
        )
    return MegatronManifest(
        layout=layout,
        dtype=layout.params_dtype,
        world_size=world_size,
        source_dir=str(hf_dir),
        source_sha256=digest,
        source_files=files,
        library_versions=library_versions(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def read_manifest(megatron_dir: str | Path) -> MegatronManifest:
    """Read and validate ``lingo_manifest.json`` in ``megatron_dir``.

    Raises:
        ManifestError: the file is missing, not JSON, or not a valid manifest.
    """
    path = Path(megatron_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(
            f"{megatron_dir}: no {MANIFEST_FILE}; was this checkpoint made by the convert step?"
        )
    try:
        return MegatronManifest.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as error:
        raise ManifestError(f"{path}: not valid JSON ({error})") from error
    except ValidationError as error:
        raise ManifestError(f"{path}: not a valid manifest: {error}") from None


def write_manifest(megatron_dir: str | Path, manifest: MegatronManifest) -> Path:
    """Write ``manifest`` atomically next to the checkpoint, read it back and compare.

    Returns:
        The manifest's path.

    Raises:
        ManifestError: what was read back differs from what was written.
    """
    directory = Path(megatron_dir)
    path = directory / MANIFEST_FILE
    atomic_write_text(path, manifest.model_dump_json(indent=2) + "\n")
    if read_manifest(directory) != manifest:
        raise ManifestError(f"{path}: the manifest read back differs from the one written")
    return path


def check_manifest(
    megatron_dir: str | Path,
    layout: MegatronLayout | None = None,
    hf_dir: str | Path | None = None,
    source_sha256: str | None = None,
) -> MegatronManifest:
    """Make sure the checkpoint in ``megatron_dir`` is the one wanted.

    Args:
        megatron_dir: the converted checkpoint.
        layout: the layout about to be used; its sharding fields (``tp``, ``pp``, ``ep``,
            ``etp``, ``cp``, ``vpp``) and ``params_dtype`` must equal the manifest's.
        hf_dir: the source model; hashed and compared with the manifest's hash.
        source_sha256: a known source hash (instead of, or as well as, ``hf_dir``).

    Returns:
        The manifest.

    Raises:
        ManifestError: no valid manifest.
        ManifestMismatch: every field that differs, with both values, in one message.
    """
    manifest = read_manifest(megatron_dir)
    differences = []
    if layout is not None:
        for field in LAYOUT_FIELDS:
            have, want = getattr(manifest.layout, field), getattr(layout, field)
            if have != want:
                differences.append(f"layout.{field}: checkpoint has {have!r}, requested {want!r}")
    wanted_hashes = []
    if source_sha256 is not None:
        wanted_hashes.append((source_sha256, "source_sha256"))
    if hf_dir is not None:
        wanted_hashes.append((hash_hf_directory(hf_dir)[0], f"hash of {hf_dir}"))
    for digest, label in wanted_hashes:
        if digest != manifest.source_sha256:
            differences.append(
                f"source: checkpoint was converted from {manifest.source_dir} "
                f"(sha256 {manifest.source_sha256}), requested {label} {digest}"
            )
    if differences:
        raise ManifestMismatch(
            f"{megatron_dir} does not match the request; reconvert, or request what it holds:\n"
            + "\n".join(f"  - {d}" for d in differences)
        )
    return manifest
