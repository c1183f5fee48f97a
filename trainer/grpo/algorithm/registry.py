"""Looking a name up in one of the algorithm's registries."""

from __future__ import annotations

from typing import TypeVar

_Entry = TypeVar("_Entry")


def lookup(registry: dict[str, _Entry], name: str, what: str) -> _Entry:
    """``registry[name]``; ValueError naming ``what`` and listing the valid names."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid names: {', '.join(sorted(registry))}")
    return registry[name]
