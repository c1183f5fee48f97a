"""The run form: a compiled pipeline's parameters, and how a run's values become its steps'
configs.

Each preset compiles to a pipeline of its own that carries the preset whole (``preset_json``).
Its form holds the fields users change (``FORM_FIELDS``: flat, typed, defaulting to the
preset's values), the run's own settings (``RUN_FIELDS``: MLflow, export, images) and
``overrides``: any other preset field in the CLI's ``--set`` syntax. The pipeline's first step
(``pipelines.configure``) applies the form's fields, then ``overrides``, to the preset it
carries with ``apply_overrides``, the function behind ``lingo … --set``: a field edited in the
form, the same assignment in ``overrides`` and ``--set`` on the CLI give the same step configs,
and every other field keeps the preset's value. A value that does not hold stops the run
there, with a message naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from core.errors import validation_message
from pipelines.overrides import AssignmentError, apply_overrides, parse_overrides
from pipelines.presets import Preset, preset_from_json, run_plan, step_configs
from plan import MEGATRON_BRANCH


@dataclass(frozen=True)
class FormField:
    """One flat parameter of the run form: it sets the preset field ``path`` (``--set``
    syntax); its default is the preset's value there, its type that value's."""

    name: str
    path: str
    description: str


FORM_FIELDS: tuple[FormField, ...] = (
    FormField(
        "data_source",
        "data_prep.source",
        "Training data: 'bundled' (the sample in the image), a Hugging Face dataset id "
        "(HuggingFaceH4/Multilingual-Thinking), a directory, .jsonl or .parquet file on the "
        "workspace volume, or s3://bucket/prefix.",
    ),
    FormField(
        "model_source",
        "model.source",
        "Base model: a Hugging Face model id (openai/gpt-oss-20b), a HF directory on the "
        "workspace volume or an s3:// prefix holding one, or 'tiny' (a small GPT-OSS built "
        "offline, for CPU demos).",
    ),
    FormField(
        "sft_max_steps",
        "sft.max_steps",
        "SFT optimizer steps; 0 trains sft_num_epochs passes over the train split.",
    ),
    FormField(
        "sft_num_epochs",
        "sft.num_epochs",
        "SFT passes over the train split, used when sft_max_steps is 0.",
    ),
    FormField("sft_learning_rate", "sft.optim.learning_rate", "SFT peak learning rate."),
    FormField("grpo_max_steps", "grpo.max_steps", "GRPO optimizer steps."),
    FormField("grpo_learning_rate", "grpo.optim.learning_rate", "GRPO peak learning rate."),
    FormField(
        "grpo_samples_per_prompt",
        "grpo.rollout.n_samples",
        "GRPO responses sampled per prompt (the group its advantages compare; at least 2).",
    ),
    FormField(
        "grpo_prompts_per_step",
        "grpo.prompts_per_step",
        "GRPO prompts per optimizer step; times grpo_samples_per_prompt it must be a "
        "multiple of the mini-batch and of the training processes.",
    ),
    FormField(
        "eval_samples",
        "eval.sampling.n",
        "Eval: responses sampled per question, for each of base, SFT and GRPO.",
    ),
    FormField(
        "gate_margin",
        "gate.margin",
        "Promotion gate: how much GRPO's gate metric must exceed the reference's (strictly) "
        "for the model to be registered as champion.",
    ),
    FormField(
        "force",
        "gate.force",
        "Retrain even when the data fingerprint equals the champion's (otherwise such a run "
        "ends after data prep as 'unchanged data').",
    ),
    FormField(
        "backend",
        "backend",
        "GRPO branch: 'hf' trains the HF weights (grpo.optim.backend: torch or deepspeed); "
        "'megatron' converts to Megatron-Core, trains there and exports back to HF.",
    ),
)
"""The fields users change, in the form's order. A preset's form holds those that apply to it
(``form_fields``)."""


@dataclass(frozen=True)
class RunField:
    """A parameter of the run itself, not of the preset: its default and description."""

    name: str
    default: str
    description: str


OVERRIDES_DESCRIPTION = (
    "Any other preset field, in lingo's --set syntax: STEP.FIELD=VALUE items separated by "
    "spaces, quoted as in a shell where a value holds one (sft.lora.r=16 "
    "grpo.rollout.temperature=0.8 eval.persona='You are …'). Applied on top of the preset's "
    "values and the fields above; every field not named keeps the preset's value."
)

RUN_FIELDS: tuple[RunField, ...] = (
    RunField("overrides", "", OVERRIDES_DESCRIPTION),
    RunField(
        "mlflow_tracking_uri",
        "",
        "MLflow tracking server URI; empty: MLFLOW_TRACKING_URI in the steps' environment, "
        "else no tracking.",
    ),
    RunField("mlflow_experiment", "", "MLflow experiment name; empty: MLFLOW_EXPERIMENT_NAME's."),
    RunField(
        "export_uri",
        "",
        "s3://bucket/prefix to publish the GRPO model and the eval results to (under the run "
        "id); empty: not published.",
    ),
)


IMAGE_FIELDS: dict[str, str] = {
    "cpu_image": "Container image of the CPU steps (data prep, capacity check, gate …).",
    "gpu_image": "Container image of the GPU steps and of the SFT/GRPO training jobs.",
    "megatron_image": "Container image of the export to HF and of the Megatron branch "
    "(conversion, GRPO on Megatron-Core).",
}
"""The image parameters, named as ``components.images`` names the images."""


class RunFormError(ValueError):
    """A run's form values or overrides do not give a valid run; the message names the
    parameter or field."""


def form_fields(preset: Preset) -> tuple[FormField, ...]:
    """The form fields that apply to ``preset``: ``backend`` only where its pipeline holds
    both GRPO branches."""
    return tuple(
        field for field in FORM_FIELDS if field.name != "backend" or len(preset.grpo_branches) > 1
    )


def field_value(preset: Preset, path: str) -> Any:
    """The value of the preset field ``path`` (``sft.optim.learning_rate``)."""
    value: Any = preset
    for key in path.split("."):
        value = getattr(value, key) if isinstance(value, BaseModel) else value[key]
    return value


def form_arguments(preset: Preset) -> dict[str, Any]:
    """The form's values for ``preset``: the preset's value of each form field and the run
    fields' defaults (the compiled pipeline's parameter defaults, images aside)."""
    values = {field.name: field_value(preset, field.path) for field in form_fields(preset)}
    return values | {field.name: field.default for field in RUN_FIELDS}


def _as_text(value: Any) -> str:
    """A form value as ``--set`` gives it: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def resolve_run(carried: str, form: Mapping[str, Any], overrides: str = "") -> Preset:
    """The run's preset: ``carried`` (``preset_json``) with the form's fields and then
    ``overrides`` applied (``apply_overrides``), checked as ``lingo compile`` checks a preset's
    config values (``pipelines.preflight.config_value_problems``).

    ``form``: form field name → value (fields not given keep the preset's value).

    Raises:
        RunFormError: a parameter the preset's form does not have; an ``overrides`` item
            that is not ``STEP.FIELD=VALUE``, sets a field its form parameter changes too, or
            does not apply to the preset; a value its field refuses; a node type other than
            the compiled one. The message names the parameter or field.
    """
    from pipelines.preflight import config_value_problems

    preset = preset_from_json(carried)
    fields = {field.name: field for field in form_fields(preset)}
    unknown = sorted(set(form) - set(fields))
    if unknown:
        raise RunFormError(
            f"parameter(s) {', '.join(unknown)}: not in the form of preset {preset.name!r} "
            f"({', '.join(fields)})"
        )
    try:
        extra = parse_overrides(overrides)
    except AssignmentError as exc:
        raise RunFormError(str(exc)) from None
    changed = {  # the form fields this run changes
        fields[name].path: name
        for name, value in form.items()
        if value != field_value(preset, fields[name].path)
    }
    for path in extra:
        if path in changed:
            raise RunFormError(
                f"overrides: {path} is also set by parameter {changed[path]}="
                f"{form[changed[path]]!r}: set it in one place"
            )
        if problem := _does_not_apply(preset, path):
            raise RunFormError(f"overrides: {path}: {problem}")
    assignments = {fields[name].path: _as_text(value) for name, value in form.items()}
    try:
        resolved = apply_overrides(preset, {**assignments, **extra})
    except ValidationError as exc:
        names = {field.path: f" (parameter {field.name})" for field in fields.values()}
        problems = []
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"])
            problems.append(f"{path}{names.get(path, '')}: {validation_message(error)}")
        raise RunFormError(f"the run's values do not hold: {'; '.join(problems)}") from None
    except ValueError as exc:
        raise RunFormError(str(exc)) from None
    if any(path.startswith("model.tiny.") for path in extra) and resolved.model.source != "tiny":
        raise RunFormError(
            f"overrides: model.tiny.* configures the tiny model, and this run's model is "
            f"{resolved.model.source!r} (model_source)"
        )
    try:  # the run's shape: its branch's layout is read here first
        plan = run_plan(resolved)
    except ValueError as exc:  # a Megatron layout's sizes, or a preset it names, do not hold
        raise RunFormError(f"megatron_layout: {exc}") from None
    # megatron_optim stands in for grpo.optim where the branch trains model-parallel
    # (plan.branch_config)
    if (
        plan.trainer.model_parallel
        and resolved.megatron_optim
        and "grpo.optim.learning_rate" in changed
    ):
        raise RunFormError(
            "parameter grpo_learning_rate: the Megatron branch's optimizer is megatron_optim, "
            "in place of grpo.optim; set its rate in overrides: "
            "megatron_optim.learning_rate=VALUE"
        )
    if resolved.hardware.platform != preset.hardware.platform:
        raise RunFormError(
            f"hardware.node_type={resolved.hardware.node_type}: the pipeline was compiled for "
            f"{preset.hardware.node_type} (its steps' node selectors, GPUs and volumes are "
            f"fixed then); compile it for the other node type: lingo compile --preset "
            f"{preset.name} --set hardware.node_type={resolved.hardware.node_type}"
        )
    if problems := config_value_problems(resolved):
        raise RunFormError("; ".join(problems))
    return resolved


def _does_not_apply(preset: Preset, path: str) -> str | None:
    """Why ``path`` cannot be overridden in ``preset``'s pipeline, or None."""
    step = path.split(".")[0]
    megatron = MEGATRON_BRANCH not in preset.grpo_branches
    if step in ("megatron_layout", "megatron_optim") and megatron:
        return (
            f"applies to the Megatron branch, which the pipeline of preset {preset.name} "
            "does not hold (grpo_branches)"
        )
    if path == "backend" and len(preset.grpo_branches) == 1:
        return f"the pipeline of preset {preset.name} holds one GRPO branch, {preset.backend}"
    return None


def check_export_uri(uri: str) -> None:
    """Refuse an ``export_uri`` that ``publish`` could not upload to (``''``: not published).

    Raises:
        ValueError: not ``s3://bucket[/prefix]``; the message names the field.
    """
    if not uri:
        return
    from core.storage import parse_s3_uri

    try:
        parse_s3_uri(uri)
    except ValueError as exc:
        raise ValueError(f"export_uri: {exc}") from None


def configure_outputs(
    carried: str, form: Mapping[str, Any], overrides: str, job_platform: str = ""
) -> dict[str, Any]:
    """The ``configure`` step's outputs: the steps' configs (``step_configs``) of the run's
    preset (``resolve_run``); the training jobs take the platform fields ``job_platform``
    (``presets.job_platform_json``, compiled in; empty: the preset's platform's)."""
    platform = json.loads(job_platform) if job_platform else None
    return step_configs(resolve_run(carried, form, overrides), platform)
