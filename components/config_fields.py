"""A step config as a KFP parameter value."""

from __future__ import annotations

from pydantic import BaseModel


def config_dict(config: BaseModel) -> dict:
    """A step config as a KFP dict parameter (JSON types). ``None`` values are left out, at
    every depth: KFP structs cannot hold null, and an optional parameter left unset is
    ``None``."""
    return config.model_dump(mode="json", exclude_none=True)
