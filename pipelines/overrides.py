"""A preset changed by name: ``--set STEP.FIELD=VALUE`` (the CLI) and the run form's
``overrides`` string parse to assignments, which ``apply_overrides`` makes into a validated
copy of the preset."""

from __future__ import annotations

import json
import shlex
from typing import Any

from pydantic import ValidationError

from cluster.hardware import Hardware
from pipelines.presets import STEPS, TRAINING_STEPS, Preset, unstated

PRESET_FIELDS = ("backend",)
"""The preset's own fields an override sets by name (``backend=megatron``)."""


class AssignmentError(ValueError):
    """A ``--set`` item or an ``overrides`` word that is not ``STEP.FIELD=VALUE``."""


def parse_assignments(items: list[str], where: str = "--set") -> dict[str, str]:
    """``["sft.max_steps=50", ...]`` → ``{"sft.max_steps": "50"}``: the ``--set`` syntax, which
    the CLI's ``--set`` and the run form's ``overrides`` share. A field given twice with the
    same value counts once.

    Raises:
        AssignmentError: an item without ``=``, or a field given twice with two values (one
            of them would be dropped without a word); the message names ``where`` and the item.
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise AssignmentError(f"{where}: {item!r} is not STEP.FIELD=VALUE")
        key = key.strip()
        if key in out and out[key] != value:
            raise AssignmentError(
                f"{where}: {key} is given twice ({out[key]!r}, then {value!r}); give it once"
            )
        out[key] = value
    return out


def parse_overrides(text: str) -> dict[str, str]:
    """The run form's ``overrides`` string: ``--set`` items separated by spaces or newlines,
    quoted as in a shell where a value holds spaces (``eval.persona='You are …'``).

    Raises:
        AssignmentError: unbalanced quotes, or an item that is not ``STEP.FIELD=VALUE``.
    """
    try:
        items = shlex.split(text)
    except ValueError as exc:
        raise AssignmentError(f"overrides: {exc} in {text!r}") from None
    return parse_assignments(items, where="overrides")


def _parse_value(value: str) -> Any:
    """A JSON value when it parses as one (numbers, booleans, lists), else the string."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def apply_overrides(preset: Preset, overrides: dict[str, str]) -> Preset:
    """A copy of ``preset`` with ``step.field[.subfield]=value`` overrides, validated.

    Examples: ``{"data_prep.eval_fraction": "0.2", "sft.optim.learning_rate": "1e-3"}``,
    ``{"backend": "megatron"}`` (``PRESET_FIELDS``).

    Raises:
        ValueError: an unknown step or field, or a value the field does not accept.
    """
    data = preset.model_dump()
    for dotted, value in overrides.items():
        path = dotted.split(".")
        if dotted in PRESET_FIELDS:
            data[dotted] = value
            continue
        if path[0] not in STEPS or len(path) < 2:
            raise ValueError(
                f"override {dotted!r}: use STEP.FIELD with STEP one of {', '.join(STEPS)} "
                f"(or {', '.join(PRESET_FIELDS)})"
            )
        node = data
        for depth, key in enumerate(path[:-1]):
            if not isinstance(node.get(key), dict):
                raise ValueError(
                    f"override {dotted!r}: {'.'.join(path[: depth + 1])} has no fields"
                )
            node = node[key]
        if path[-1] not in node:
            fields = ", ".join(node)
            raise ValueError(f"override {dotted!r}: no field {path[-1]!r} ({fields})")
        node[path[-1]] = _parse_value(value) if not isinstance(node[path[-1]], str) else value
    # a cluster step's processes come from the (new) hardware again, unless stated; given
    # before the step configs are validated, which check their batch sizes against them
    derived = [
        step
        for step in TRAINING_STEPS
        if "nproc" not in getattr(preset, step).model_fields_set
        and f"{step}.nproc" not in overrides
    ]
    try:
        hardware = Hardware.model_validate(data["hardware"])
    except ValidationError:
        hardware = None  # Preset.model_validate says what is wrong with it
    for step in derived:
        processes = hardware.processes(step) if hardware is not None else None
        if processes is None:
            del data[step]["nproc"]  # local: the step's default
        else:
            data[step]["nproc"] = processes
    result = Preset.model_validate(data)
    for step in derived:
        setattr(result, step, unstated(getattr(result, step), "nproc"))
    return result
