"""Where the pipeline's base model comes from: the tiny model, a local directory, or the hub."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

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
    """
    output_dir = Path(output_dir)
    if source == TINY:
        return build_tiny_model(output_dir, tiny)
    if source.startswith("s3://"):
        from core.storage import download_dir

        log.info("downloading %s", source)
        download_dir(source, output_dir, require_manifest=False)
        return check_model_dir(output_dir)
    if Path(source).exists():
        check_model_dir(source)
        shutil.copytree(source, output_dir, dirs_exist_ok=True)
        return output_dir
    if looks_like_path(source):
        raise ModelSourceError(
            f"model source {source}: no such model directory (looked for "
            f"{Path(source).expanduser().absolute()})"
        )
    try:
        find_on_hub(source, "model")
    except HubLookupError as exc:
        raise ModelSourceError(f"model source {source}: not a local directory, and {exc}") from None
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the hub", source)
    snapshot_download(repo_id=source, local_dir=output_dir)
    return check_model_dir(output_dir)
