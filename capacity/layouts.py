"""Cluster layouts the planner checks: one typed model, named presets, ``key=value`` overrides.

Field names follow OpenRLHF's flags where one exists (``micro_train_batch_size``,
``generate_max_len``, ``zero_stage``, ``adam_offload``, ``vllm_gpu_memory_utilization``,
``max_ckpt_num`` ...), so a layout reads like the launch command it stands for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.hardware import Hardware
from cluster.nodes import NODE_TYPES, sender_network_gbps
from plan import ParallelSizes, TrainerSpec, trainer_spec


class LayoutError(ValueError):
    """A layout name, override or combination of settings that cannot describe a cluster."""


class Layout(BaseModel):
    """Where and how one SFT/GRPO run trains and generates.

    Attributes:
        name: preset name (or ``custom``).
        device: ``cuda``, or ``cpu`` for the local run (a "GPU" is then one training process
            and ``gpu_memory_gib`` is ignored: processes share the host's memory).
        nodes: machines.
        gpus_per_node: accelerators per machine.
        gpu_memory_gib: memory of one accelerator as the driver reports it.
        host_memory_gib: RAM of one machine.
        host_reserved_gib: RAM the OS, kubelet and sidecars keep; the rest is usable.
        storage_gib: size of the volume that holds checkpoints.
        backend: training backend, ``deepspeed`` (stage 0 on one rank is plain PyTorch) or
            ``megatron``.
        training_gpus: accelerators that train (packed onto the first nodes).
        rollout_gpus: accelerators that run vLLM; 0 when rollouts use the training model.
        hybrid: vLLM shares the training GPUs and sleeps while they train (OpenRLHF
            ``--colocate_all_models``, verl's hybrid engine); otherwise rollout GPUs are
            separate and placed after the training GPUs.
        zero_stage: DeepSpeed ZeRO stage 0-3.
        partitioned_load: ZeRO-3 builds the model partitioned (``zero.Init``) and fills it one
            gathered tensor at a time, so no rank holds it whole (this project's loader and
            OpenRLHF's); false: every rank loads the whole model onto its GPU, through its
            host, and DeepSpeed partitions it afterwards. Below ZeRO-3 the load is whole.
        final_model_on_rank0: the step ends on rank 0's host with the whole trained model and
            its reload (SFT: the LoRA merge and its check).
        adam_offload: optimizer states on the host (DeepSpeed ``offload_optimizer``, Megatron
            ``optimizer_cpu_offload``).
        param_offload: ZeRO-3 ``offload_param``: bf16 weights partitions on the host.
        deepspeed_enable_sleep: in a hybrid layout, training states move to the host while
            vLLM is awake (OpenRLHF flag of that name; verl's param/grad/optimizer offload).
        tensor_parallel: Megatron TP.
        pipeline_parallel: Megatron PP.
        expert_parallel: Megatron EP.
        dtype: training weights/activations dtype.
        micro_train_batch_size: sequences per training micro-batch per rank.
        prompt_max_len: longest prompt in tokens.
        generate_max_len: longest completion in tokens.
        gradient_checkpointing: recompute each layer in backward, keep only layer inputs.
        attn_implementation: the kernel training runs: ``eager`` materializes the ``S×S``
            scores (the HF trainer's on every device; Megatron's off Hopper); ``flash`` keeps
            ``O(S)`` (Megatron's fused kernel on Hopper). A node's layout
            (``node_fields``) says what its GPU offers; the run's layout says what its
            backend runs there (``core.attention.training_attention``).
        lora_rank: LoRA rank; 0 trains every weight.
        lora_experts: LoRA also on the expert matrices (peft ``target_parameters``).
        kl: a reference model is kept for the KL term (``init_kl_coef > 0``).
        ref_offload: the reference model waits on the host (OpenRLHF
            ``--ref_reward_offload``).
        rollout_batch_size: prompts per rollout step.
        n_samples_per_prompt: completions per prompt (the GRPO group size).
        rollout_dtype: weights dtype in vLLM; ``mxfp4`` packs the expert matrices as
            gpt-oss ships them (4-bit values plus one 8-bit scale per 32).
        vllm_tensor_parallel_size: GPUs per vLLM engine.
        vllm_gpu_memory_utilization: share of a GPU's memory vLLM may claim.
        vllm_sleep_level: 1 backs weights up to host memory while asleep; 2 drops them.
        vllm_max_num_seqs: most sequences one engine runs at once.
        vllm_max_num_batched_tokens: tokens per scheduler step (sizes vLLM's profile run).
        reduce_bucket_size: DeepSpeed gradient reduce bucket, in elements (its default).
        max_ckpt_num: training checkpoints kept on the volume.
        hf_ckpt_num: HF exports kept on the volume.
        network_gbps: a node's network, Gb/s (``cluster.nodes.NodeType``); None: not stated.
        sender_network_gbps: what one GPU's process reaches of it (``sender_network_gbps``).
        intra_node_gbps: one GPU's bandwidth to the node's other GPUs, Gb/s.
        sync_bucket_mb: the weight sync's bucket (``rollout.sync_bucket_mb``).
        rollouts: the step samples rollouts and syncs its policy to them (GRPO); false for
            SFT, which the planner models with the same fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = "custom"
    device: Literal["cuda", "cpu"] = "cuda"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    gpu_memory_gib: float = Field(80.0, gt=0)
    host_memory_gib: float = Field(1024.0, gt=0)
    host_reserved_gib: float = Field(8.0, ge=0)
    storage_gib: float = Field(1000.0, gt=0)
    backend: Literal["deepspeed", "megatron"] = "deepspeed"
    training_gpus: int = Field(8, ge=1)
    rollout_gpus: int = Field(0, ge=0)
    hybrid: bool = False
    zero_stage: int = Field(3, ge=0, le=3)
    partitioned_load: bool = True
    final_model_on_rank0: bool = False
    adam_offload: bool = False
    param_offload: bool = False
    deepspeed_enable_sleep: bool = False
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    dtype: Literal["bf16", "fp32"] = "bf16"
    micro_train_batch_size: int = Field(1, ge=1)
    prompt_max_len: int = Field(1024, ge=1)
    generate_max_len: int = Field(1024, ge=1)
    gradient_checkpointing: bool = True
    attn_implementation: Literal["eager", "flash"] = "flash"
    lora_rank: int = Field(0, ge=0)
    lora_experts: bool = False
    kl: bool = True
    ref_offload: bool = False
    rollout_batch_size: int = Field(128, ge=1)
    n_samples_per_prompt: int = Field(8, ge=1)
    rollout_dtype: Literal["bf16", "fp32", "mxfp4"] = "bf16"
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    vllm_sleep_level: int = Field(1, ge=1, le=2)
    vllm_max_num_seqs: int = Field(256, ge=1)
    vllm_max_num_batched_tokens: int = Field(8192, ge=1)
    reduce_bucket_size: int = Field(500_000_000, ge=1)
    max_ckpt_num: int = Field(3, ge=0)
    hf_ckpt_num: int = Field(1, ge=0)
    network_gbps: float | None = Field(None, gt=0)
    sender_network_gbps: float | None = Field(None, gt=0)
    intra_node_gbps: float | None = Field(None, gt=0)
    sync_bucket_mb: int = Field(64, ge=1)
    rollouts: bool = True

    @model_validator(mode="after")
    def _check_placement(self) -> Layout:
        total = self.nodes * self.gpus_per_node
        if self.training_gpus > total:
            raise ValueError(f"training_gpus={self.training_gpus} > nodes × gpus_per_node={total}")
        if self.hybrid and self.rollout_gpus > self.training_gpus:
            raise ValueError("hybrid: rollout_gpus must be ≤ training_gpus (they are shared)")
        if not self.hybrid and self.training_gpus + self.rollout_gpus > total:
            raise ValueError(
                f"training_gpus + rollout_gpus = {self.training_gpus + self.rollout_gpus} > "
                f"nodes × gpus_per_node = {total}; lower one or set hybrid=true"
            )
        if self.rollout_gpus % self.vllm_tensor_parallel_size:
            raise ValueError("rollout_gpus must be a multiple of vllm_tensor_parallel_size")
        if self.device == "cpu" and self.rollout_gpus:
            raise ValueError("device=cpu rolls out with the training model: set rollout_gpus=0")
        if self.param_offload and self.zero_stage != 3:
            raise ValueError("param_offload needs zero_stage=3")
        if self.trainer.model_parallel:
            problems = self.parallel_sizes.problems(self.training_gpus, "training_gpus")
            if problems:
                raise ValueError(f"{self.backend}: " + "; ".join(problems))
        return self

    @property
    def trainer(self) -> TrainerSpec:
        """The spec of the layout's backend (``plan.trainer_spec``)."""
        return trainer_spec(self.backend, "backend")

    @property
    def parallel_sizes(self) -> ParallelSizes:
        """The layout's parallel sizes (the planner models ``cp = etp = 1``)."""
        return ParallelSizes(
            tp=self.tensor_parallel, pp=self.pipeline_parallel, ep=self.expert_parallel
        )

    @property
    def sequence_length(self) -> int:
        """Longest training sequence: prompt plus completion."""
        return self.prompt_max_len + self.generate_max_len

    @property
    def vllm_num_engines(self) -> int:
        """vLLM engines (each ``vllm_tensor_parallel_size`` GPUs)."""
        return self.rollout_gpus // self.vllm_tensor_parallel_size

    @property
    def whole_model_load(self) -> bool:
        """Every training rank loads the whole model before training (DeepSpeed below ZeRO-3,
        or ZeRO-3 without ``partitioned_load``); Megatron ranks read their own shards."""
        partitioned = self.trainer.zero and self.zero_stage == 3 and self.partitioned_load
        return not (self.trainer.model_parallel or partitioned)

    @property
    def weight_bytes(self) -> int:
        """Bytes per training weight/activation element."""
        return 2 if self.dtype == "bf16" else 4


def node_fields(node_type: str, nodes: int = 1) -> dict[str, object]:
    """The ``Layout`` fields of ``nodes`` machines of ``node_type`` (``cluster.nodes.NODE_TYPES``):
    device, GPUs per node and their memory, host memory and what the system keeps of it, and
    the attention kernel the GPU offers (``flash`` where it has a fused one with sinks, else
    ``eager``; what a run's backend runs there is ``core.attention.training_attention``).
    A CPU node keeps the default ``gpu_memory_gib``, which a CPU layout ignores."""
    node = NODE_TYPES[node_type]
    return {
        "network_gbps": node.network_gbps,
        "sender_network_gbps": sender_network_gbps(node),
        "intra_node_gbps": node.intra_node_gbps,
        "device": node.device,
        "nodes": nodes,
        "gpus_per_node": node.gpus,
        **({"gpu_memory_gib": node.gpu_memory_gib} if node.gpu_memory_gib else {}),
        "host_memory_gib": node.host_memory_gib,
        "host_reserved_gib": node.host_reserved_gib,
        "attn_implementation": "flash" if node.flash_attention else "eager",
    }


_OPENRLHF_G5: dict[str, object] = {
    **node_fields("g5.12xlarge", nodes=6),
    "storage_gib": 2000.0,
    "backend": "deepspeed",
    "zero_stage": 3,
    "adam_offload": True,
    "gradient_checkpointing": True,
    "micro_train_batch_size": 1,
    "prompt_max_len": 1024,
    "generate_max_len": 1024,
    "rollout_batch_size": 64,
    "n_samples_per_prompt": 8,
    "vllm_tensor_parallel_size": 4,
    "vllm_gpu_memory_utilization": 0.85,
    "max_ckpt_num": 3,
}

LAYOUT_PRESETS: dict[str, Layout] = {
    # Reference A: OpenRLHF on 6× g5.12xlarge (4× A10G 24 GB, 192 GiB RAM each), ZeRO-3 with
    # Adam offload on the first 4 nodes, two TP=4 vLLM engines on the last 2.
    "g5.12xlarge-x6-openrlhf": Layout(
        name="g5.12xlarge-x6-openrlhf", training_gpus=16, rollout_gpus=8, **_OPENRLHF_G5
    ),
    # The same cluster split 12 training GPUs (3 nodes) / 12 rollout GPUs (3 engines).
    "g5.12xlarge-x6-openrlhf-12train": Layout(
        name="g5.12xlarge-x6-openrlhf-12train", training_gpus=12, rollout_gpus=12, **_OPENRLHF_G5
    ),
    # Hybrid on the same cluster: every GPU trains, vLLM (TP=4) sleeps in between.
    "g5.12xlarge-x6-openrlhf-hybrid": Layout(
        name="g5.12xlarge-x6-openrlhf-hybrid",
        training_gpus=24,
        rollout_gpus=24,
        hybrid=True,
        deepspeed_enable_sleep=True,
        **{**_OPENRLHF_G5, "vllm_gpu_memory_utilization": 0.8},
    ),
    # Reference B: verl/Megatron style on 2× p5en.48xlarge (8× H200, 2 TiB RAM each) for
    # gpt-oss-120b: EP=16 over all GPUs, optimizer on the host, hybrid vLLM TP=8.
    "p5en.48xlarge-x2-megatron": Layout(
        name="p5en.48xlarge-x2-megatron",
        **node_fields("p5en.48xlarge", nodes=2),
        storage_gib=8000.0,
        backend="megatron",
        training_gpus=16,
        rollout_gpus=16,
        hybrid=True,
        deepspeed_enable_sleep=True,
        adam_offload=True,
        tensor_parallel=1,
        pipeline_parallel=1,
        expert_parallel=16,
        micro_train_batch_size=1,
        prompt_max_len=1024,
        generate_max_len=4096,
        gradient_checkpointing=True,
        rollout_batch_size=128,
        n_samples_per_prompt=8,
        vllm_tensor_parallel_size=8,
        vllm_gpu_memory_utilization=0.7,
        max_ckpt_num=2,
    ),
    # The local run: one fp32 PyTorch process on CPU, rollouts with the training model.
    "tiny-cpu": Layout(
        name="tiny-cpu",
        **node_fields("local"),
        storage_gib=10.0,
        backend="deepspeed",
        training_gpus=1,
        rollout_gpus=0,
        zero_stage=0,
        dtype="fp32",
        micro_train_batch_size=4,
        prompt_max_len=128,
        generate_max_len=128,
        gradient_checkpointing=False,
        kl=False,
        rollout_batch_size=8,
        n_samples_per_prompt=8,
        max_ckpt_num=2,
    ),
}


HARDWARE_FIELDS = frozenset(
    {
        "device",
        "nodes",
        "gpus_per_node",
        "gpu_memory_gib",
        "host_memory_gib",
        "host_reserved_gib",
        "storage_gib",
    }
)
"""Layout fields a preset's ``Hardware`` states; its layout overrides may not restate them."""


def hardware_layout(hardware: Hardware) -> Layout:
    """The planner's description of ``hardware``'s machines (the run's own fields, such as
    processes, batch and lengths, come from the configs: ``sft_layout``, ``grpo_layout``)."""
    nodes = max(hardware.sft_nodes, hardware.grpo_nodes)
    return Layout(
        name=hardware.node_type,
        **node_fields(hardware.node_type, nodes),
        training_gpus=nodes * hardware.node.gpus,
        storage_gib=hardware.storage_gib,
    )


def parallel_fields(sizes: ParallelSizes) -> dict[str, int]:
    """The layout fields of a run's parallel sizes (``plan.ParallelSizes``, the plan's one
    "layout"): tensor, pipeline and expert parallel sizes under the planner's names."""
    return {"tensor_parallel": sizes.tp, "pipeline_parallel": sizes.pp, "expert_parallel": sizes.ep}


def resolve_layout(layout: str | Layout, overrides: dict[str, str] | None = None) -> Layout:
    """Return a preset (or a given layout) with ``key=value`` overrides applied and checked.

    Args:
        layout: a preset name from ``LAYOUT_PRESETS`` or a ``Layout``.
        overrides: field name → value as typed on a command line (``"8"``, ``"true"``).

    Returns:
        The validated layout.

    Raises:
        LayoutError: unknown preset or field, a value of the wrong type, or a placement that
            cannot exist; the message names the offending input.
    """
    if isinstance(layout, str):
        if layout not in LAYOUT_PRESETS:
            raise LayoutError(
                f"unknown layout {layout!r}; presets: {', '.join(sorted(LAYOUT_PRESETS))}"
            )
        layout = LAYOUT_PRESETS[layout]
    if not overrides:
        return layout
    unknown = sorted(set(overrides) - set(Layout.model_fields))
    if unknown:
        raise LayoutError(
            f"unknown layout field(s) {', '.join(unknown)}; "
            f"fields: {', '.join(Layout.model_fields)}"
        )
    try:
        return Layout.model_validate({**layout.model_dump(), **overrides})
    except ValidationError as error:
        raise LayoutError(f"layout {layout.name!r} with overrides {overrides}: {error}") from None
