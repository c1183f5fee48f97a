"""Put the terms together: one ``Estimate`` with a verdict per resource."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capacity.host_memory import CPU_PROCESS_RSS_GIB, host_node_terms, node_roles
from capacity.layouts import Layout, resolve_layout
from capacity.model_spec import ModelSpec, ParameterCount, count_parameters, load_model_spec
from capacity.quantities import (
    GIB,
    Resource,
    Term,
    Verdict,
    advice_for,
    find_keyed,
    sum_terms,
    verdict_for,
)
from capacity.rollout_memory import VLLM_CONTEXT_GIB, KvCapacity, rollout_gpu_terms
from capacity.storage import storage_terms
from capacity.sync_time import NoSync, SyncTime, model_sync
from capacity.training_memory import (
    CUDA_RUNTIME_GIB,
    gpu_resident_state,
    load_description,
    trainable_parameters,
    training_rank_terms,
)

_ORDER = {Verdict.FITS: 0, Verdict.TIGHT: 1, Verdict.DOES_NOT_FIT: 2}


@dataclass(frozen=True)
class Estimate:
    """A model on a layout: parameters, and every resource with its terms and verdict.

    Attributes:
        model: the model's shape.
        parameters: its parameter count.
        trainable_parameters: parameters the optimizer updates.
        layout: the layout, overrides applied.
        resources: training GPU, rollout GPU, host per node kind, storage (those that apply).
        kv: the rollout engines' KV-cache capacity, when there are rollout GPUs.
        sync: one weight sync's modeled time (dedicated engines on a stated interconnect),
            or ``NoSync`` (colocated engines: nothing moves, and what a sync would move).
    """

    model: ModelSpec
    parameters: ParameterCount
    trainable_parameters: int
    layout: Layout
    resources: tuple[Resource, ...]
    kv: KvCapacity | None
    sync: SyncTime | NoSync | None = None

    @property
    def verdict(self) -> Verdict:
        """The worst verdict over all resources."""
        return max((r.verdict for r in self.resources), key=_ORDER.__getitem__)

    @property
    def fits(self) -> bool:
        """True unless some resource does not fit."""
        return self.verdict is not Verdict.DOES_NOT_FIT

    def resource(self, key: str) -> Resource:
        """Return the resource named ``key`` (``training_gpu``, ``host_node0``, ...).

        Raises:
            KeyError: the layout has no such resource.
        """
        return find_keyed(self.resources, key, "resource")


def _resource(
    key: str, label: str, capacity: float, terms: list[Term], detail: str = ""
) -> Resource:
    verdict = verdict_for(sum_terms(terms), capacity)
    advice = advice_for(terms, verdict)
    return Resource(key, label, capacity, tuple(terms), verdict, advice, detail)


def _full_training_comparison(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> str:
    """LoRA: what one rank would hold training every weight on the same GPUs (the terms LoRA
    removes: the base's gradients and optimizer states), as a detail line."""
    full = layout.model_copy(update={"lora_rank": 0, "lora_experts": False})
    total = sum_terms(training_rank_terms(spec, counts, full))
    verdict = verdict_for(total, layout.gpu_memory_gib * GIB)
    trainable = trainable_parameters(spec, counts, layout)
    reference = ", and the KL reference is the base with the adapter off" if layout.kl else ""
    step = "GRPO" if layout.rollouts else "fine-tuning"
    return (
        f"LoRA: {trainable / counts.total:.2%} of the weights train: the frozen base has no "
        f"gradients or optimizer states{reference}; full {step} on these GPUs: "
        f"{total.expected / GIB:.1f} GiB expected a rank ({verdict.value})"
    )


def _training_resource(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> Resource:
    terms = training_rank_terms(spec, counts, layout)
    load = load_description(spec, counts, layout)
    if layout.lora_rank and layout.device == "cuda":
        load += "\n  " + _full_training_comparison(spec, counts, layout)
    host_capacity = (layout.host_memory_gib - layout.host_reserved_gib) * GIB
    if layout.device == "cpu":
        ranks = min(layout.gpus_per_node, layout.training_gpus)
        terms.append(Term("process", "Python + torch process", CPU_PROCESS_RSS_GIB * GIB))
        return _resource(
            "training_gpu", "memory / training process (CPU)", host_capacity / ranks, terms, load
        )
    if layout.hybrid:
        terms.append(
            Term(
                "vllm_asleep",
                "vLLM asleep on this GPU (context, CUDA graphs)",
                VLLM_CONTEXT_GIB * GIB,
                "non-hybrid (rollout GPUs of their own)",
            )
        )
    return _resource(
        "training_gpu", "GPU memory / training rank", layout.gpu_memory_gib * GIB, terms, load
    )


def _rollout_resource(
    spec: ModelSpec, counts: ParameterCount, layout: Layout
) -> tuple[Resource, KvCapacity]:
    runtime = CUDA_RUNTIME_GIB * GIB
    if layout.hybrid and not layout.deepspeed_enable_sleep:
        resident = sum_terms(gpu_resident_state(spec, counts, layout)) + runtime
    else:
        resident = runtime
    terms, kv = rollout_gpu_terms(spec, counts, layout, resident)
    capacity = layout.gpu_memory_gib * GIB
    verdict = verdict_for(sum_terms(terms), capacity)
    if kv.sequences < 1:
        verdict = Verdict.DOES_NOT_FIT
    elif kv.sequences < kv.wanted and verdict is Verdict.FITS:
        verdict = Verdict.TIGHT
    advice = list(advice_for(terms, verdict))
    if kv.sequences < kv.wanted:
        advice.insert(0, "shorter generate_max_len (fewer KV tokens per sequence)")
    detail = (
        f"KV cache holds {kv.sequences} sequences of {kv.seq_len} tokens at once per engine "
        f"({layout.vllm_num_engines} engines); a rollout step asks for {kv.wanted}"
    )
    resource = Resource(
        "rollout_gpu",
        f"GPU memory / rollout GPU (vLLM TP={layout.vllm_tensor_parallel_size})",
        capacity,
        tuple(terms),
        verdict,
        tuple(advice),
        detail,
    )
    return resource, kv


def _host_resources(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> list[Resource]:
    resident = sum_terms(gpu_resident_state(spec, counts, layout))
    capacity = (layout.host_memory_gib - layout.host_reserved_gib) * GIB
    seen: set[tuple[int, int, bool]] = set()
    resources = []
    for role in node_roles(layout):
        kind = (role.training_ranks, role.rollout_gpus, role.holds_rank0)
        if kind in seen or not (role.training_ranks or role.rollout_gpus):
            continue
        seen.add(kind)
        label = (
            f"host memory / node {role.index} ({role.training_ranks} training ranks, "
            f"{role.rollout_gpus} vLLM GPUs{', rank 0' if role.holds_rank0 else ''})"
        )
        terms = host_node_terms(spec, counts, layout, role, resident)
        resources.append(_resource(f"host_node{role.index}", label, capacity, terms))
    return resources


def estimate_layout(spec: ModelSpec, layout: Layout) -> Estimate:
    """Estimate every resource of ``layout`` for the model ``spec``.

    Args:
        spec: the model's shape.
        layout: a validated layout.

    Returns:
        The estimate.
    """
    counts = count_parameters(spec)
    resources = [_training_resource(spec, counts, layout)]
    kv = None
    if layout.rollout_gpus:
        rollout, kv = _rollout_resource(spec, counts, layout)
        resources.append(rollout)
    if layout.device == "cuda":
        resources.extend(_host_resources(spec, counts, layout))
    resources.append(
        _resource(
            "storage",
            "storage / checkpoint volume",
            layout.storage_gib * GIB,
            storage_terms(spec, counts, layout),
        )
    )
    trainable = trainable_parameters(spec, counts, layout)
    return Estimate(
        model=spec,
        parameters=counts,
        trainable_parameters=trainable,
        layout=layout,
        resources=tuple(resources),
        kv=kv,
        sync=model_sync(counts, layout, adapter=trainable),
    )


def estimate(
    model: str | Path | Mapping[str, Any],
    layout: str | Layout,
    overrides: Mapping[str, str] | None = None,
) -> Estimate:
    """Estimate a model (preset, directory, ``config.json`` or mapping) on a layout preset.

    Args:
        model: see ``load_model_spec``.
        layout: a preset name from ``LAYOUT_PRESETS`` or a ``Layout``.
        overrides: ``key=value`` layout overrides as strings.

    Returns:
        The estimate.

    Raises:
        ModelSpecError: the model cannot be read.
        LayoutError: the layout or an override is invalid.
    """
    return estimate_layout(load_model_spec(model), resolve_layout(layout, dict(overrides or {})))
