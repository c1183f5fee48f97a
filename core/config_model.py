"""The base of every typed configuration: unknown fields, non-finite floats and booleans given
for numbers are rejected when the config is parsed, with the field's name.

``--set grpo.optim.learning_rate=Infinity`` or ``sft.max_steps=true`` parse as JSON to ``inf``
and ``True``; pydantic's default (lax) mode would accept both (``True`` as 1), and the run
would fail much later, or not at all.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _takes_number_not_bool(annotation: Any) -> bool:
    """Whether a field's type accepts ints or floats (or int literals) but not booleans."""
    origin = get_origin(annotation)
    if origin is Literal:
        args = get_args(annotation)
        return any(
            isinstance(a, int | float) and not isinstance(a, bool) for a in args
        ) and not any(isinstance(a, bool) for a in args)
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        return bool not in args and any(_takes_number_not_bool(a) for a in args)
    return annotation in (int, float)


class ConfigModel(BaseModel):
    """A config model: ``extra="forbid"``, finite floats only, no ``true`` for a number."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _takes_number_not_bool(field.annotation):
                raise ValueError(f"expected a number, got the boolean {value!r}")
        return value
