"""Where the pipeline's base model comes from: the tiny model, a local directory, or the hub."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from core.atomic import discard_staging, publish_dir, staging_dir
from core.hub import HubLookupError, find_on_hub, looks_like_path
from core.modeling import check_model_dir
from trainer.tiny_model import TinyModelConfig, build_tiny_model

log = logging.getLogger(__name__)

TINY = "tiny"


class ModelSourceError(ValueError):
    """A model source that is neither the tiny model, a local directory, s3:// nor a hub id."""


def materialize_base_model(source: str, output_dir: str | Path, tiny: TinyModelConfig) -> Path:
    """Put the base model in ``output_dir`` as a HF directory.

    ``source``: ``tiny`` (built here, offline), a local model directory (copied), an
    ``s3://bucket/prefix`` holding one (downloaded with integrity checks, see
    ``core.storage``), or a hub id such as ``openai/gpt-oss-20b`` (downloaded with
    ``huggingface_hub``; needs the network).

    The model is written in a staging folder beside ``output_dir`` and put in place whole
    (``core.atomic.publish_dir``): a step killed half way (its run interrupted) leaves no
    ``output_dir`` holding only some of the files, which a later step would take as a model.
    """
    output_dir = Path(output_dir)
    if source.startswith("s3://"):
        from core.storage import download_dir

        log.info("downloading %s", source)
        download_dir(source, output_dir, require_manifest=False)  # staged there, then renamed
        return check_model_dir(output_dir)
    if source != TINY and not Path(source).exists():
        _check_remote_source(source)
    staged = staging_dir(output_dir)
    try:
        _materialize(source, staged, tiny)
        check_model_dir(staged)
    except BaseException:
        discard_staging(staged)
        raise
    return publish_dir(staged, output_dir, "the base model folder")


def _check_remote_source(source: str) -> None:
    """Refuse a source that is neither a local directory nor a hub id that exists."""
    if looks_like_path(source):
        raise ModelSourceError(
            f"model source {source}: no such model directory (looked for "
            f"{Path(source).expanduser().absolute()})"
        )
    try:
        find_on_hub(source, "model")
    except HubLookupError as exc:
        raise ModelSourceError(f"model source {source}: not a local directory, and {exc}") from None


def _materialize(source: str, output_dir: Path, tiny: TinyModelConfig) -> None:
    if source == TINY:
        build_tiny_model(output_dir, tiny)
    elif Path(source).exists():
        check_model_dir(source)
        shutil.copytree(source, output_dir, dirs_exist_ok=True)
    else:
        from huggingface_hub import snapshot_download

        log.info("downloading %s from the hub", source)
        snapshot_download(repo_id=source, local_dir=output_dir)
