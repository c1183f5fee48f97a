"""A source string: a local path, or a Hugging Face hub id looked up once, bounded.

``datasets`` and ``huggingface_hub`` downloads retry for half a minute when the hub cannot be
reached, and a path-looking string that is not a repo id fails with ``HFValidationError``.
``looks_like_path`` tells a path from an ``org/name`` id without touching the network, and
``find_on_hub`` makes one request with a timeout before a download, so a mistyped path or an
unreachable hub is one clear error at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".gz")
HUB_LOOKUP_TIMEOUT_S = 10.0


class HubLookupError(RuntimeError):
    """A hub id that is not on the hub, or a hub that cannot be reached to look it up."""


def looks_like_path(source: str) -> bool:
    """Whether ``source`` names a local path rather than a hub id (``org/name``): it starts
    with ``.``, ``/`` or ``~``, has more than one ``/`` or a ``\\``, ends in a data file
    extension, or its first part is an existing local folder (``data/rows`` beside ``data/``).
    A URL (``scheme://…``) is neither: it is never looked for on disk."""
    if "://" in source:
        return False
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source
        or source.lower().endswith(DATA_FILE_SUFFIXES)
        or ("/" in source and Path(source.split("/", 1)[0]).is_dir())
    )


def _offline() -> bool:
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _cached(repo_id: str, repo_type: str) -> bool:
    """Whether a copy of the repo is in the local Hugging Face caches (usable offline)."""
    from huggingface_hub import constants

    folder = f"{repo_type}s--{repo_id.replace('/', '--')}"
    if (Path(constants.HF_HUB_CACHE) / folder).is_dir():
        return True
    if repo_type != "dataset":
        return False
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
    return (datasets_cache / repo_id.replace("/", "___")).is_dir()


def find_on_hub(
    repo_id: str,
    repo_type: Literal["dataset", "model"],
    timeout_s: float = HUB_LOOKUP_TIMEOUT_S,
) -> None:
    """Check, with one request of at most ``timeout_s``, that ``repo_id`` is on the hub.

    Nothing is checked offline (``HF_HUB_OFFLINE=1``…) or when the repo is in the local cache
    and the hub does not answer (the download then reads the cache).

    Raises:
        HubLookupError: ``repo_id`` is not a valid id, is not on the hub (or is private and no
            token is set), or the hub cannot be reached and the repo is not cached.
    """
    if _offline():
        return
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
    )

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=timeout_s)
    except GatedRepoError:
        return  # it exists; the download says what access it needs
    except RepositoryNotFoundError:
        raise HubLookupError(
            f"no {repo_type} {repo_id!r} on the Hugging Face hub (or it is private: set HF_TOKEN)"
        ) from None
    except HFValidationError as exc:
        raise HubLookupError(f"{repo_id!r} is not a hub id: {exc}") from None
    except Exception as exc:  # the network: httpx / requests errors, 5xx answers
        if _cached(repo_id, repo_type):
            return
        raise HubLookupError(
            f"the Hugging Face hub ({constants.ENDPOINT}) cannot be reached to look up the "
            f"{repo_type} {repo_id!r} ({type(exc).__name__}: {exc}); check the network, or set "
            "HF_HUB_OFFLINE=1 to use the local cache"
        ) from None
