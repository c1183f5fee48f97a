"""Megatron parallel layouts, and the checks that run before any weight is loaded.

Megatron-Core lays two rank grids over the same processes
(``megatron.core.parallel_state.initialize_model_parallel``): the dense grid
``world = TP × CP × DP × PP`` for attention and everything else, and the expert grid
``world = ETP × EP × expert-DP × PP`` for the routed experts. ``validate_layout`` reads only
the model's ``config.json`` and checks a layout against those grids and the model's shapes;
every rule that fails is reported, all at once, in one ``LayoutError``:

- TP divides ``vocab_size`` (the bridge does not pad the vocabulary for TP);
- TP divides ``num_attention_heads`` and ``num_key_value_heads`` (a rank holds whole heads and
  whole query groups);
- PP divides ``num_hidden_layers`` (even stages); a virtual PP needs PP ≥ 2 and divides
  ``num_hidden_layers / PP``;
- EP divides the expert count (``num_local_experts``); EP > 1 needs a MoE model;
- ETP is 1 for GPT-OSS (the bridge's GPT-OSS mapping and verl's recipe keep experts whole);
- ``world = TP × PP × CP × DP`` with an integer DP ≥ 1 (derived when not given);
- ``ETP × EP × PP`` divides the world size (Megatron-Core raises "world_size is not divisible
  by expert_tensor_model_pipeline_parallel size" otherwise); these two grids are
  ``plan.ParallelSizes``'s rules, the one copy every layer checks;
- sequence parallelism needs TP > 1, and EP > 1 with TP > 1 needs sequence parallelism
  (Megatron-Core's ``ModelParallelConfig`` raises otherwise); for a layout that trains
  (``training=True``), TP > 1 on a MoE model needs sequence parallelism at any EP
  (megatron-core 0.19.2 ``transformer/moe/moe_layer.py:629``, ``MoELayer.forward``, raises in
  training mode; conversion, export and forward-only use run without it);
- the rollout engine's TP divides the attention heads and the world size;
- one training rank fits its GPU, as the capacity planner (``capacity``) estimates it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from capacity import (
    MODEL_PRESETS,
    Estimate,
    Layout,
    ModelSpecError,
    Verdict,
    estimate_layout,
    format_table,
    load_model_spec,
)
from capacity import LayoutError as PlannerLayoutError
from capacity.layouts import parallel_fields
from cluster.nodes import H100_GIB
from core.config_model import ConfigModel
from plan import ParallelSizes
from plan.megatron_layouts import (
    MEGATRON_LAYOUT_PRESETS,
    UnknownMegatronLayoutError,
    megatron_layout_fields,
    verl_gpt_oss_fields,
)

log = logging.getLogger(__name__)

# Planner fields the Megatron layout sets itself; the rest may be given in ``planner``.
_DERIVED_PLANNER_FIELDS = frozenset(
    {
        "name",
        "device",
        "nodes",
        "gpus_per_node",
        "gpu_memory_gib",
        "backend",
        "training_gpus",
        "tensor_parallel",
        "pipeline_parallel",
        "expert_parallel",
        "dtype",
        "vllm_tensor_parallel_size",
    }
)


class LayoutError(PlannerLayoutError):
    """A Megatron layout that cannot run the model; ``problems`` lists every failed rule."""

    def __init__(self, problems: list[str], context: str = "", note: str = "") -> None:
        self.problems = list(problems)
        header = f"Megatron layout {context}is invalid ({len(problems)} problem(s)):"
        lines = [header, *(f"  - {p}" for p in problems)]
        super().__init__("\n".join([*lines, note] if note else lines))


def _planner_fields_model() -> type[BaseModel]:
    """``PlannerFields``: every ``capacity.Layout`` field but those the Megatron layout sets
    itself, with the planner's types, bounds and defaults (stated once, in ``Layout``)."""

    class _Base(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        @model_validator(mode="before")
        @classmethod
        def _named_fields(cls, value: Any) -> Any:
            names = set(value) if isinstance(value, Mapping) else set()
            unknown = sorted(names - set(Layout.model_fields))
            derived = sorted(names & _DERIVED_PLANNER_FIELDS)
            if unknown:
                raise ValueError(f"unknown planner Layout field(s) {', '.join(unknown)}")
            if derived:
                raise ValueError(
                    f"{', '.join(derived)} come from the Megatron layout itself; set "
                    "tp/pp/ep/params_dtype/nodes/gpus_per_node/gpu_memory_gib/rollout_tp instead"
                )
            return value

    fields = {
        name: (field.annotation, field)
        for name, field in Layout.model_fields.items()
        if name not in _DERIVED_PLANNER_FIELDS
    }
    return create_model("PlannerFields", __base__=_Base, **fields)


PlannerFields = _planner_fields_model()
"""The further ``capacity.Layout`` fields of a Megatron layout's memory estimate
(``micro_train_batch_size``, ``prompt_max_len``, ``generate_max_len``, ``adam_offload``, ``kl``,
``ref_offload``, ``gradient_checkpointing`` ...): typed and bounded as the planner's, unknown
names and the fields the Megatron layout decides itself refused. Only the fields given are
passed to the planner (``model_fields_set``); the others keep the planner's defaults."""


class MegatronLayout(ConfigModel):
    """How Megatron splits the model and where it runs.

    Attributes:
        name: preset name, or ``custom``.
        tp: tensor parallel size (splits attention heads and dense matrices).
        pp: pipeline parallel size (splits the layers into stages).
        ep: expert parallel size (splits the routed experts).
        etp: expert tensor parallel size (splits each expert's matrices); 1 for GPT-OSS.
        cp: context parallel size (splits the sequence in attention).
        dp: data parallel size; ``None`` derives it from the world size.
        vpp: virtual pipeline stages per pipeline rank (interleaved schedule); ``None``: off.
        sequence_parallel: split layer-norm/dropout activations along the sequence over TP.
        params_dtype: dtype of the weights in the Megatron checkpoint and in training.
        nodes: machines; the world size is ``nodes × gpus_per_node`` unless given.
        gpus_per_node: GPUs per machine.
        gpu_memory_gib: memory of one GPU as the driver reports it; ``None`` skips the
            memory check (CPU runs).
        rollout_tp: tensor parallel size of each vLLM rollout engine.
        planner: further ``capacity.Layout`` fields for the memory estimate
            (``micro_train_batch_size``, ``prompt_max_len``, ``generate_max_len``,
            ``adam_offload``, ``kl``, ``ref_offload``, ``gradient_checkpointing`` ...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    dp: int | None = Field(None, ge=1)
    vpp: int | None = Field(None, ge=1)
    sequence_parallel: bool = False
    params_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1)
    gpu_memory_gib: float | None = Field(None, gt=0)
    rollout_tp: int = Field(1, ge=1)
    planner: PlannerFields = Field(default_factory=lambda: PlannerFields())

    @property
    def parallel_sizes(self) -> ParallelSizes:
        """The layout's tp, pp, ep, etp, cp and dp (``plan.ParallelSizes``)."""
        return ParallelSizes(
            tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp, dp=self.dp
        )

    def megatron_kwargs(self) -> dict[str, Any]:
        """The layout under Megatron-Core's names (``ModelParallelConfig`` / bridge provider)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
            "context_parallel_size": self.cp,
            "sequence_parallel": self.sequence_parallel,
        }

    @property
    def torch_dtype(self):
        """``params_dtype`` as a ``torch.dtype``."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            self.params_dtype
        ]


def verl_gpt_oss_layout(nodes: int = 8, gpu_memory_gib: float = H100_GIB) -> MegatronLayout:
    """verl's gpt-oss Megatron recipe on ``nodes`` × 8 H100/H800 (``plan.megatron_layouts``:
    TP 8, EP 8, ETP 1, PP = nodes, colocated vLLM of TP 4, host offload, full recompute)."""
    return MegatronLayout.model_validate(verl_gpt_oss_fields(nodes, gpu_memory_gib))


MEGATRON_LAYOUTS: dict[str, MegatronLayout] = {
    name: MegatronLayout.model_validate(fields) for name, fields in MEGATRON_LAYOUT_PRESETS.items()
}
"""The named layouts (``plan.MEGATRON_LAYOUT_PRESETS``), checked as layouts."""


def resolve_megatron_layout(layout: str | Mapping[str, Any] | MegatronLayout) -> MegatronLayout:
    """A preset name, a mapping (``{"preset": name, **overrides}`` or plain fields) or a layout.

    Raises:
        LayoutError: unknown preset, unknown field or a value of the wrong type.
    """
    if isinstance(layout, MegatronLayout):
        return layout
    if isinstance(layout, str):
        layout = {"preset": layout}
    fields = dict(layout)
    preset = fields.pop("preset", None)
    if preset is not None:
        try:
            megatron_layout_fields({"preset": preset})  # the one check of the name
        except UnknownMegatronLayoutError as error:
            raise LayoutError([str(error)]) from None
        fields = {**MEGATRON_LAYOUTS[preset].model_dump(), **fields}
    try:
        return MegatronLayout.model_validate(fields)
    except ValidationError as error:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'layout'}: {e['msg']}" for e in error.errors()
        ]
        raise LayoutError(problems) from None


def conversion_layout(layout: str | Mapping[str, Any] | MegatronLayout) -> MegatronLayout:
    """The layout the convert step writes a checkpoint at: one process, nothing split.

    The convert step runs as one process (a KFP pod, no ``torchrun``), so Megatron-Core's
    grid there is a world of one: a layout of TP 8 / EP 8 cannot be initialised in it
    (``initialize_model_parallel`` raises "world_size (1) is not divisible by 8"). A
    ``torch_dist`` checkpoint does not fix the layout it is loaded at: every tensor is saved
    with its global shape and its shard's offsets, and ``dist_checkpointing.load`` reads,
    for each rank of the loading layout, the slices that rank's model asks for (the GRPO
    backend, the export and the precision check all load that way). So the checkpoint is
    written at TP = PP = EP = ETP = CP = 1 in the training layout's ``params_dtype``, and
    the training job reshards it when it loads. The name stays the training layout's.
    """
    layout = resolve_megatron_layout(layout)
    return MegatronLayout(name=layout.name, params_dtype=layout.params_dtype)


def read_model_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The model's ``config.json`` as a dict: a mapping, a planner preset, a directory or file.

    Raises:
        ModelSpecError: no readable ``config.json`` there.
    """
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str) and source in MODEL_PRESETS:
        return dict(MODEL_PRESETS[source])
    path = Path(source)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ModelSpecError(f"{source}: no config.json (expected a Hugging Face model directory)")
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ModelSpecError(f"{config_path}: not valid JSON ({error})") from error


def expert_count(config: Mapping[str, Any]) -> int | None:
    """Routed experts per MoE layer, or ``None`` for a dense model."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return None


@dataclass(frozen=True)
class ValidatedLayout:
    """A layout that passed every rule.

    Attributes:
        layout: the layout with ``dp`` filled in.
        world_size: processes (GPUs) in the job.
        expert_data_parallel: data-parallel size of the expert grid,
            ``world / (ETP × EP × PP)``.
        estimate: the planner's estimate, when the GPU memory was checked.
        warnings: what is legal but slow or tight.
    """

    layout: MegatronLayout
    world_size: int
    expert_data_parallel: int
    estimate: Estimate | None
    warnings: tuple[str, ...]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _shape_problems(config: Mapping[str, Any], layout: MegatronLayout) -> list[str]:
    """Rules between the layout and the model's shapes."""
    problems = []
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config["num_hidden_layers"])
    experts = expert_count(config)
    if heads % layout.tp:
        problems.append(
            f"tp={layout.tp} does not divide num_attention_heads={heads} (each tensor-parallel "
            f"rank holds whole heads); tp must be one of {_divisors(heads)}"
        )
    if kv_heads % layout.tp:
        problems.append(
            f"tp={layout.tp} does not divide num_key_value_heads={kv_heads} (each tensor-parallel "
            f"rank holds whole query groups); tp must be one of {_divisors(kv_heads)}"
        )
    vocab = config.get("vocab_size")
    if vocab and int(vocab) % layout.tp:
        problems.append(
            f"tp={layout.tp} does not divide vocab_size={vocab} (the embedding and output layer "
            "are split by vocabulary over TP and megatron-bridge 0.6 does not pad it)"
        )
    if layers % layout.pp:
        problems.append(
            f"pp={layout.pp} does not divide num_hidden_layers={layers} (pipeline stages hold "
            f"equal numbers of layers); pp must be one of {_divisors(layers)}"
        )
    elif layout.vpp is not None:
        # any vpp, 1 included, turns the interleaved schedule on: Megatron-Core's
        # initialize_model_parallel raises on it with pp=1
        per_stage = layers // layout.pp
        if layout.pp < 2:
            problems.append(f"vpp={layout.vpp} needs pp ≥ 2 (interleaved schedule); pp=1")
        elif per_stage % layout.vpp:
            problems.append(
                f"vpp={layout.vpp} does not divide the {per_stage} layers per pipeline stage "
                f"(num_hidden_layers={layers} / pp={layout.pp}); vpp must be one of "
                f"{_divisors(per_stage)}"
            )
    if experts is None and layout.ep > 1:
        problems.append(f"ep={layout.ep} but the model has no experts (not a MoE config)")
    elif experts is not None and experts % layout.ep:
        problems.append(
            f"ep={layout.ep} does not divide num_local_experts={experts} (each expert-parallel "
            f"rank holds the same number of experts); ep must be one of {_divisors(experts)}"
        )
    if config.get("model_type") == "gpt_oss" and layout.etp != 1:
        problems.append(
            f"etp={layout.etp}: GPT-OSS needs etp=1 (the bridge's GPT-OSS expert mapping and "
            "verl's recipe keep every expert's matrices whole; split experts with ep instead)"
        )
    if heads % layout.rollout_tp:
        problems.append(
            f"rollout_tp={layout.rollout_tp} does not divide num_attention_heads={heads} "
            f"(vLLM splits whole heads); rollout_tp must be one of {_divisors(heads)}"
        )
    return problems


def _grid_problems(layout: MegatronLayout, world: int) -> tuple[list[str], int | None]:
    """Rules between the layout and the world size; returns the problems and the derived DP.

    The two grids are ``plan.ParallelSizes``'s rules; sequence parallelism and the rollout
    engines' TP are the Megatron layout's own."""
    sizes = layout.parallel_sizes
    problems = sizes.problems(world)
    dp = None if world % sizes.model_parallel else world // sizes.model_parallel
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("sequence_parallel=true needs tp > 1 (it splits activations over TP)")
    if layout.ep > 1 and layout.tp > 1 and not layout.sequence_parallel:
        problems.append(
            f"ep={layout.ep} with tp={layout.tp} needs sequence_parallel=true (Megatron-Core: "
            "'When using expert parallelism and tensor parallelism, sequence parallelism must "
            "be used')"
        )
    if world % layout.rollout_tp:
        problems.append(
            f"rollout_tp={layout.rollout_tp} does not divide world size {world} (vLLM engines "
            "are packed onto the training GPUs)"
        )
    return problems, dp


def _training_problems(config: Mapping[str, Any], layout: MegatronLayout) -> list[str]:
    """Rules only a layout that trains must meet.

    Megatron-Core 0.19.2 refuses to train a MoE layer split over TP without sequence
    parallelism: ``MoELayer.forward`` (``megatron/core/transformer/moe/moe_layer.py:629``)
    raises ``ValueError`` when ``self.training`` and the attention TP group has more than one
    rank and ``config.sequence_parallel`` is off. Eval-mode forwards (conversion's precision
    check, the reference's log-probs, the export) are not refused, so conversion with TP > 1
    and no sequence parallelism stays valid. With EP > 1 the grid rule already says it.
    """
    if expert_count(config) is None or layout.tp == 1 or layout.sequence_parallel:
        return []
    if layout.ep > 1:
        return []  # "ep > 1 with tp > 1 needs sequence_parallel" (``_grid_problems``)
    return [
        f"tp={layout.tp} on a MoE model needs sequence_parallel=true to train (Megatron-Core "
        "refuses a training forward of a MoE layer split over TP without it, "
        "moe_layer.py:629); set sequence_parallel=true (needs Transformer Engine or apex "
        "LayerNorm) or train with tp=1"
    ]


def planner_layout(layout: MegatronLayout, world: int, gpu_memory_gib: float) -> Layout:
    """The capacity planner's view of a Megatron layout (training ranks only, no rollout GPUs).

    Raises:
        PlannerLayoutError: the planner rejects the combination (its message says why).
    """
    fields: dict[str, Any] = {
        "rollout_gpus": 0,
        "hybrid": False,
        **layout.planner.model_dump(exclude_unset=True),
        "name": f"megatron:{layout.name}",
        "device": "cuda",
        "backend": "megatron",
        "nodes": max(layout.nodes, math.ceil(world / layout.gpus_per_node)),
        "gpus_per_node": layout.gpus_per_node,
        "gpu_memory_gib": gpu_memory_gib,
        "training_gpus": world,
        **parallel_fields(layout.parallel_sizes),
        "dtype": "fp32" if layout.params_dtype == "fp32" else "bf16",
        "vllm_tensor_parallel_size": layout.rollout_tp,
    }
    try:
        return Layout.model_validate(fields)
    except ValidationError as error:
        raise PlannerLayoutError(f"planner layout for {layout.name!r}: {error}") from None


def _memory_check(
    config: Mapping[str, Any], layout: MegatronLayout, world: int, gpu_memory_gib: float
) -> tuple[list[str], Estimate | None, list[str]]:
    """The planner's verdict on one training rank: (problems, estimate, warnings)."""
    try:
        spec = load_model_spec(config)
        result = estimate_layout(spec, planner_layout(layout, world, gpu_memory_gib))
    except (ModelSpecError, PlannerLayoutError) as error:
        return [f"GPU memory: cannot estimate ({error})"], None, []
    training = result.resource("training_gpu")
    expected_gib = training.total.expected / 2**30
    if training.verdict is Verdict.DOES_NOT_FIT:
        advice = f"; advice: {'; '.join(training.advice)}" if training.advice else ""
        return (
            [
                f"GPU memory: one training rank needs ~{expected_gib:.1f} GiB, more than "
                f"gpu_memory_gib={gpu_memory_gib:g} (capacity planner{advice})"
                f"\n{format_table(result)}"
            ],
            result,
            [],
        )
    warnings = []
    if training.verdict is Verdict.TIGHT:
        warnings.append(
            f"GPU memory is tight: ~{expected_gib:.1f} GiB of {gpu_memory_gib:g} GiB per rank"
        )
    return [], result, warnings


def validate_layout(
    hf_config_or_dir: str | Path | Mapping[str, Any],
    layout: str | Mapping[str, Any] | MegatronLayout,
    world_size: int | None = None,
    gpu_memory_gib: float | None = None,
    training: bool = False,
) -> ValidatedLayout:
    """Check a Megatron layout against a model before any weight is loaded.

    Args:
        hf_config_or_dir: the model's HF directory, its ``config.json``, the parsed config or
            a planner model preset (``gpt-oss-20b``); only the config is read.
        layout: a ``MegatronLayout``, a preset name or a mapping (see
            ``resolve_megatron_layout``).
        world_size: processes in the job; default ``nodes × gpus_per_node``.
        gpu_memory_gib: memory of one GPU; default the layout's. ``None`` in both skips the
            memory check.
        training: the layout will train (the GRPO step's Megatron backend), not only convert
            or export: the rules of ``_training_problems`` apply too.

    Returns:
        The layout with its data-parallel size, and the memory estimate when checked.

    Raises:
        LayoutError: one or more rules fail; ``problems`` lists each with its numbers.
        ModelSpecError: the config cannot be read.
    """
    layout = resolve_megatron_layout(layout)
    config = read_model_config(hf_config_or_dir)
    missing = [k for k in ("num_attention_heads", "num_hidden_layers") if k not in config]
    if missing:
        raise ModelSpecError(f"{hf_config_or_dir}: config.json lacks {', '.join(missing)}")
    world = world_size if world_size is not None else layout.nodes * layout.gpus_per_node
    if world < 1:
        raise LayoutError([f"world_size={world}: must be ≥ 1"], f"{layout.name!r} ")
    problems = _shape_problems(config, layout)
    grid, dp = _grid_problems(layout, world)
    problems += grid
    if training:
        problems += _training_problems(config, layout)
    warnings = []
    if layout.tp > layout.gpus_per_node:
        warnings.append(
            f"tp={layout.tp} spans more than one node ({layout.gpus_per_node} GPUs each): "
            "tensor-parallel traffic leaves NVLink"
        )
    memory = gpu_memory_gib if gpu_memory_gib is not None else layout.gpu_memory_gib
    estimate = None
    note = ""
    if memory is not None:
        if problems:
            note = "(GPU memory is checked once the rules above pass)"
        else:
            memory_problems, estimate, memory_warnings = _memory_check(
                config, layout, world, memory
            )
            problems += memory_problems
            warnings += memory_warnings
    if problems:
        raise LayoutError(
            problems, f"{layout.name!r} for {config.get('model_type', 'model')} ", note
        )
    assert dp is not None  # no problems means the world divides tp × pp × cp
    for warning in warnings:
        log.warning("Megatron layout %s: %s", layout.name, warning)
    return ValidatedLayout(
        layout=layout.model_copy(update={"dp": dp}),
        world_size=world,
        expert_data_parallel=layout.parallel_sizes.expert_data_parallel(world),
        estimate=estimate,
        warnings=tuple(warnings),
    )
