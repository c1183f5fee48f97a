"""What a registry lookup shares: the one error for a name no registry holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S")


class UnknownSpecError(ValueError):
    """A configuration names a trainer backend or rollout engine that is not registered."""


def whole(value: object, name: str) -> int:
    """``value`` as an int: an int, or a float with no fraction (KFP passes a dict parameter's
    numbers as JSON numbers, which a pipeline step reads back as floats: ``nproc`` 8.0).

    Raises:
        ValueError: anything else; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r} must be a whole number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}={value!r} must be a whole number")
    return int(value)


def lookup(registry: Mapping[str, S], name: str, field: str, what: str) -> S:
    """``registry[name]``, or ``UnknownSpecError`` naming ``field`` and the valid names (the
    wording of the project's other registries: ``trainer.grpo.algorithm``'s).

    Args:
        registry: the specs by name.
        name: the name the configuration gives.
        field: the configuration field that gave it (``optim.backend``, ``rollout.engine``).
        what: what the registry holds, for the message (``trainer backend``).
    """
    try:
        return registry[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(registry))
        article = "an" if what[:1] in "aeiou" else "a"
        raise UnknownSpecError(
            f"{field}={name!r} is not {article} {what}; valid names: {known}"
        ) from None
