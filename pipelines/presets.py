"""Named, typed configurations of the whole pipeline.

A preset holds one typed config per step. The pipeline's parameters are these configs'
fields (prefixed by step), and their defaults come from the config classes, so the local run,
the compiled pipeline and the cluster job share one source of every default.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from data_prep.config import DataPrepConfig


class Preset(BaseModel):
    """A named configuration of every step."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    data_prep: DataPrepConfig = DataPrepConfig()


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in [
        Preset(
            name="tiny-cpu",
            description="Laptop demo: bundled sample, tiny GPT-OSS model, CPU only, no network.",
            data_prep=DataPrepConfig(source="bundled"),
        ),
        Preset(
            name="gpt-oss-20b",
            description=(
                "openai/gpt-oss-20b on the full HuggingFaceH4/Multilingual-Thinking dataset "
                "(cluster: needs the hub or an S3 copy)."
            ),
            data_prep=DataPrepConfig(source="HuggingFaceH4/Multilingual-Thinking"),
        ),
    ]
}
DEFAULT_PRESET = "tiny-cpu"

STEP_PREFIXES = {"data_prep": "data"}
"""Pipeline parameter name = f"{prefix}_{field}" for each step config in a preset."""


class UnknownPresetError(KeyError):
    """A preset name that is not in PRESETS."""

    def __str__(self) -> str:
        return f"unknown preset {self.args[0]!r}; choose one of: {', '.join(PRESETS)}"


def get_preset(name: str) -> Preset:
    """The preset called ``name``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(name) from None


def apply_overrides(preset: Preset, overrides: dict[str, str]) -> Preset:
    """A copy of ``preset`` with ``step.field=value`` overrides, validated by the configs.

    Example: ``{"data_prep.eval_fraction": "0.2"}``.

    Raises:
        ValueError: an unknown step or field, or a value the field does not accept.
    """
    data = preset.model_dump()
    for dotted, value in overrides.items():
        step, _, field = dotted.partition(".")
        if step not in STEP_PREFIXES or not field:
            raise ValueError(
                f"override {dotted!r}: use STEP.FIELD with STEP one of {', '.join(STEP_PREFIXES)}"
            )
        if field not in data[step]:
            fields = ", ".join(data[step])
            raise ValueError(f"override {dotted!r}: {step} has no field {field!r} ({fields})")
        data[step][field] = value
    return Preset.model_validate(data)


def pipeline_arguments(preset: Preset) -> dict[str, object]:
    """The pipeline's parameter values for ``preset``."""
    args: dict[str, object] = {}
    for step, prefix in STEP_PREFIXES.items():
        for field, value in getattr(preset, step).model_dump().items():
            args[f"{prefix}_{field}"] = value
    return args
