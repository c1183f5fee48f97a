"""Named, typed configurations of the whole pipeline.

A preset holds one typed config per step and states its machines once (``hardware``). Each
preset compiles to a pipeline of its own that carries it whole (``preset_json``); what the
steps take is derived from it at run time (``step_configs``): the platform, each training
step's execution (``step_execution``), the capacity check's layout, the Megatron layout's
machine fields and the GRPO placement plan (``pipelines.preset_capacity``) all come from
``hardware``; their defaults come from the config classes, so the local run, the compiled
pipeline and the cluster job share one source of every default. A run changes a preset
with ``--set`` assignments (``pipelines.overrides``), from the CLI or the run form
(``pipelines.run_form``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.config import ClusterConfig, ExecutionConfig
from cluster.hardware import Hardware, Step
from cluster.serving import ServingConfig
from components.config_fields import config_dict
from core.config_model import ConfigModel
from data_prep.config import HUB_DATASET_ID, DataPrepConfig
from eval.eval_config import EvalConfig, SamplingSettings
from eval.gate import GateConfig
from plan import MEGATRON_MACHINE_FIELDS, RunPlan
from trainer.backends.config import OptimConfig
from trainer.grpo.config import AlgorithmConfig, GRPOConfig, GuardConfig, RolloutConfig
from trainer.sft.config import LoraSettings, SFTConfig
from trainer.tiny_model import TinyModelConfig


class ModelSource(BaseModel):
    """The base model: ``tiny`` (built offline), a local HF directory, or a hub id."""

    model_config = ConfigDict(extra="forbid")

    source: str = "tiny"
    tiny: TinyModelConfig = TinyModelConfig()


class Preset(BaseModel):
    """A named configuration of every step."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    data_prep: DataPrepConfig = DataPrepConfig()
    model: ModelSource = ModelSource()
    sft: SFTConfig = Field(default_factory=SFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    hardware: Hardware = Hardware()
    """The machines, stated once: node type (``local``, ``g5.12xlarge``, ``p5en.48xlarge``),
    nodes per training step, checkpoint volume. The platform settings, each step's job,
    the placement plan, the capacity check's layout and the Megatron layout's machine fields
    derive from it."""
    cluster: ClusterConfig = ClusterConfig()
    """How the training steps' jobs are submitted on a cluster: the job API (``auto``,
    ``trainjob``, ``pytorchjob``), the Trainer runtime, the Kueue queue, OpenShift AI's
    progress tracking. Unused where ``hardware`` is ``local``."""
    serving: ServingConfig = ServingConfig()
    """How the champion is served: a KServe InferenceService running vLLM, applied by the
    ``deploy`` step on promote (``enabled``: cluster presets); ``lingo serve`` locally."""
    layout_overrides: dict[str, str] = Field(default_factory=dict)
    """Capacity-planner layout fields the run's configs do not decide (``vllm_max_num_seqs``,
    ``attn_implementation`` ...); not the machines (``hardware``)."""
    backend: Literal["hf", "megatron"] = "hf"
    """The GRPO branch: ``hf`` trains the HF weights with ``grpo.optim.backend`` (``torch``
    or ``deepspeed``) and writes the policy as a HF directory; ``megatron`` runs
    convert_megatron → GRPO on Megatron-Core → export_hf."""
    grpo_branches: tuple[Literal["hf", "megatron"], ...] = ("hf",)
    """The GRPO branches compiled into the preset's pipeline. With both, its run form has a
    ``backend`` parameter that picks one per run; with one, the pipeline holds only it (and
    ``megatron_layout``, ``megatron_optim`` apply only where ``megatron`` is one)."""
    megatron_layout: dict[str, Any] = Field(default_factory=lambda: {"preset": "tiny-cpu"})
    """``trainer.megatron.layout`` parallel layout of the Megatron branch (a preset name +
    overrides: ``tp``, ``pp``, ``ep`` ...); its machine fields come from ``hardware``."""
    megatron_optim: dict[str, Any] = Field(default_factory=dict)
    """The Megatron branch's GRPO ``optim`` block (learning rate, schedule, and
    ``megatron``: recompute, optimizer offload) in place of ``grpo.optim``, whose ZeRO and
    offload flags are DeepSpeed's; its ``gradient_checkpointing`` is then off (recompute
    stands for it). Empty: ``grpo.optim`` with ``backend: megatron``
    (``plan.branch_config``)."""

    @model_validator(mode="after")
    def _backend_is_a_branch(self) -> Preset:
        if self.backend not in self.grpo_branches:
            raise ValueError(
                f"backend={self.backend!r} is not one of the preset's GRPO branches "
                f"{list(self.grpo_branches)} (grpo_branches)"
            )
        return self

    @model_validator(mode="after")
    def _hardware_stated_once(self) -> Preset:
        from capacity.layouts import HARDWARE_FIELDS

        restated = sorted(set(self.layout_overrides) & HARDWARE_FIELDS)
        restated += sorted(set(self.megatron_layout) & set(MEGATRON_MACHINE_FIELDS))
        if restated:
            raise ValueError(
                f"{', '.join(restated)}: the machines are stated once, in hardware "
                "(node_type, sft_nodes, grpo_nodes, storage_gib)"
            )
        for step in TRAINING_STEPS:
            config = getattr(self, step)
            processes = self.hardware.processes(step)
            if processes is None or config.nproc == processes:
                continue
            if "nproc" in config.model_fields_set:
                nodes = self.hardware.nodes(step)
                raise ValueError(
                    f"{step}.nproc={config.nproc} but hardware gives {step} {nodes} "
                    f"{self.hardware.node_type} node(s) × {self.hardware.node.gpus} GPUs = "
                    f"{processes} processes: leave {step}.nproc out (on a cluster it is derived "
                    f"from hardware) or change hardware.{step}_nodes"
                )
            try:
                setattr(self, step, _derived(config, nproc=processes))
            except ValidationError as error:
                problems = "; ".join(e["msg"] for e in error.errors())
                raise ValueError(
                    f"{step} with nproc={processes} (from hardware): {problems}"
                ) from None
        return self


TRAINING_STEPS: tuple[Step, ...] = ("sft", "grpo")
"""The steps whose processes a cluster preset's ``hardware`` decides (their ``nproc``)."""


def _derived(config: ConfigModel, **fields: object) -> ConfigModel:
    """``config`` with ``fields`` derived from elsewhere (validated), still counted as not
    stated (``model_fields_set``): a preset rebuilt from this one (``apply_overrides``)
    derives them again from its own ``hardware``."""
    validated = type(config).model_validate({**config.model_dump(), **fields})
    return unstated(validated, *fields)


def unstated(config: ConfigModel, *fields: str) -> ConfigModel:
    """``config`` as it is, with ``fields`` counted as not stated."""
    stated = config.model_fields_set - set(fields)
    return type(config).model_construct(_fields_set=stated, **dict(config))


TINY_CPU = Preset(
    name="tiny-cpu",
    description="Laptop demo: bundled sample, tiny GPT-OSS model, CPU only, no network.",
    # ~300 rows are too few for a model trained from scratch to learn languages rather than
    # rows: "auto" adds 9 synthetic recombinations per train row of the bundled sample (~3,000
    # examples, data_prep/augment.py) and none to any other source, decided from the values
    # the step sees: a user who changes only data_source in the KFP UI gets no synthetic rows
    data_prep=DataPrepConfig(source="bundled", augment_factor="auto"),
    # a 4,096-token vocabulary (the default is 2,048) makes most words one token: responses
    # are ~30% fewer tokens, so they fit GRPO's 128-token limit, and each token carries its
    # language (measured: SFT both-language accuracy 0.14 -> 0.69 on the 50-question eval)
    model=ModelSource(source="tiny", tiny=TinyModelConfig(vocab_size=4096)),
    sft=SFTConfig(
        # the tiny base model is random: the adapter needs capacity, and the embeddings and
        # output layer train fully beside it (peft modules_to_save)
        lora=LoraSettings(
            r=32, alpha=64, experts=True, modules_to_save=["embed_tokens", "lm_head"]
        ),
        optim=OptimConfig(learning_rate=3e-3, warmup_steps=10),
        micro_batch_size=8,
        gradient_accumulation_steps=2,
        # trained to convergence for its own sake: the held-out loss stops falling at ~250-300
        # steps (5.57, 5.56, 5.55 at 200, 250, 300; 5.62 at 500), so the last fifth never
        # lowers it by 2%. 500 steps, not 300: the held-out loss is flat, but the language of
        # the reasoning keeps improving (50-question eval, both languages right: 0.34 at 300
        # steps, 0.49 at 500), and GRPO needs it (from 300 steps it raised the answer
        # language and lost the reasoning's: both 0.29; from 500: 0.84; docs/benchmarks.md)
        max_steps=500,
        eval_every=50,
        checkpoint_every=100,
        dtype="float32",
        cpu_threads=2,  # the demo's steps run one at a time: both cores (~2x faster)
    ),
    grpo=GRPOConfig(
        # measured on 2 CPU cores (docs/grpo.md): lr 3e-4 learns in 60-90 steps, >= 1e-3 collapses
        # sampled at the eval's temperature, 0.7, with the tempered policy softmax(z / 0.7)
        # trained (docs/grpo.md): at 1.0 the policy loops at the eval's 0.7 (loop rate 0.092,
        # both-language 0.896); at 0.7, two seeds: 0.020 / 0.004, 0.944 / 0.932
        # (docs/benchmarks.md, "Training at the eval's temperature")
        rollout=RolloutConfig(n_samples=8, max_new_tokens=128, temperature=0.7),
        algorithm=AlgorithmConfig(kl_loss_coef=0.0),
        # the policy exported is the best held-out one that meets issue #43's bar in every
        # language: reasoning >= 0.8x the SFT model's median length, loops <= 0.05 (at the
        # default 0.5 / 1.0, seed 42 exported a step with Spanish loops 0.06 and Italian
        # reasoning 0.77x on the 50-question eval; docs/benchmarks.md)
        guard=GuardConfig(min_reasoning_length_ratio=0.8, max_loop_rate=0.05),
        optim=OptimConfig(learning_rate=3e-4, lr_scheduler="constant", warmup_steps=0),
        # the deployed task only: questions written in the language they ask for (with every
        # prompt, ~75% of the labels say "answer in English" and GRPO learns that instead)
        prompt_filter="in-language",
        prompts_per_step=8,
        mini_batch_size=64,
        micro_batch_size=16,
        # 80, not 40: the held-out both-language accuracy still climbs at step 40 (0.74; 0.89 at
        # 60), and at 40 Spanish ended below SFT on the 50-question eval (0.42 vs 0.60); from
        # the same SFT model 80 steps give every language >= 0.70 and >= SFT (es 0.72,
        # docs/benchmarks.md), exported at step 70 (the best held-out reward)
        max_steps=80,
        eval_every=10,
        eval_prompts=64,
        eval_samples=2,
        checkpoint_every=20,
        dtype="float32",
        # one thread: the rollout's token-by-token decode is many small ops, where a second
        # thread costs more in synchronization than it gains (and ~10x when a core is busy)
        cpu_threads=1,
    ),
    # the 50 questions for base, SFT and GRPO side by side; the tiny model's answers are short.
    # 10 samples per question: 500 responses per model, 100 per language. Issue #43's bar is
    # per language (loops <= 0.05): at 5 samples one response is 0.02 of a language, and the
    # same GRPO model measured en loops 0.06, 0.00, 0.00 at eval seeds 0, 1, 2
    # (docs/benchmarks.md, "The held-out guard and the eval's resolution")
    eval=EvalConfig(
        sampling=SamplingSettings(max_tokens=160, n=10), batch_size=50, dtype="float32"
    ),
)

GPT_OSS_20B = Preset(
    name="gpt-oss-20b",
    description=(
        "openai/gpt-oss-20b on the full HuggingFaceH4/Multilingual-Thinking dataset; "
        "SFT on 2 g5.12xlarge nodes (8 A10G) with DeepSpeed ZeRO-3, GRPO on 4 (16 A10G), each "
        "as a TrainJob or PyTorchJob (cluster: needs the hub or an S3 copy)."
    ),
    # SFT on 2 nodes, GRPO's 16 training processes on 4; its 2 dedicated vLLM engines (TP 4)
    # on the 2 nodes after them (OpenRLHF's 6-node layout)
    hardware=Hardware(node_type="g5.12xlarge", sft_nodes=2, grpo_nodes=4, storage_gib=2000),
    # on promote, the champion served by vLLM on one g5.12xlarge's 4 A10G (TP 4, as the GRPO
    # engines), ~42 GB of bf16 weights, 8 k context
    serving=ServingConfig(enabled=True, cpu="16", memory="96Gi"),
    data_prep=DataPrepConfig(source=HUB_DATASET_ID),
    model=ModelSource(source="openai/gpt-oss-20b"),
    sft=SFTConfig(
        # as the OpenAI cookbook's multilingual-reasoner recipe: LoRA r=8 on attention and
        # experts, lr 2e-4 cosine, 1 epoch
        lora=LoraSettings(r=8, alpha=16, experts=True),
        optim=OptimConfig(
            backend="deepspeed", zero_stage=3, learning_rate=2e-4, warmup_steps=10, min_lr_ratio=0.1
        ),
        max_seq_len=2048,
        # 1 × 16 rather than 4 × 4 (the same 16 sequences per rank and step): the capacity
        # check puts 4 × 2,048 tokens at 33.5 GiB on a 22.5 GiB A10G (the logits' backward
        # over a 201k vocabulary), 1 × 2,048 at 15.6 GiB
        micro_batch_size=1,
        gradient_accumulation_steps=16,
        num_epochs=1.0,
        eval_every=50,
        checkpoint_every=100,
        dtype="bfloat16",
        gradient_checkpointing=True,
    ),
    grpo=GRPOConfig(
        # OpenRLHF's gpt-oss-20b recipe on 6x g5.12xlarge: vLLM TP=4 on dedicated GPUs
        # (non-hybrid), ZeRO-3 + Adam offload for training, generate_max_len 256; verl's
        # GRPO loss settings (clip 0.2/0.28, dual clip 10, low_var_kl 0.001, token-mean)
        rollout=RolloutConfig(
            engine="vllm",
            n_samples=8,
            max_new_tokens=256,
            max_prompt_tokens=1024,
            temperature=1.0,
            tensor_parallel_size=4,
            gpu_memory_utilization=0.85,
            colocate=False,
            num_engines=2,
            # verl's one-step off-policy: the engines sample step k+1 while step k trains
            async_steps=1,
        ),
        algorithm=AlgorithmConfig(kl_loss_coef=0.001, kl_estimator="low_var_kl"),
        optim=OptimConfig(
            backend="deepspeed",
            zero_stage=3,
            offload_optimizer=True,
            learning_rate=5e-7,
            lr_scheduler="constant",
            warmup_steps=5,
        ),
        prompts_per_step=32,
        mini_batch_size=64,
        micro_batch_size=1,
        max_steps=100,
        eval_every=10,
        eval_prompts=50,
        checkpoint_every=10,
        dtype="bfloat16",
        gradient_checkpointing=True,
    ),
)

# the p5en presets' champion served by vLLM on one H200 (141 GB): the 20b model's bf16 weights
# and its KV cache
P5EN_SERVING = ServingConfig(enabled=True, gpus=1, cpu="16", memory="128Gi")

GPT_OSS_20B_VERL = Preset.model_validate(
    {
        **dict(GPT_OSS_20B),
        "name": "gpt-oss-20b-verl",
        "description": (
            "openai/gpt-oss-20b with verl's GRPO settings for gpt-oss: n=16, clip 0.2/0.28, "
            "dual clip 10, low_var_kl 0.001, token-mean, one step off-policy: training on one "
            "p5en node (8 H200), 2 dedicated vLLM engines (TP 4) on a second; DeepSpeed "
            "ZeRO-3 by default, backend=megatron for verl's TP 8 / EP 8 Megatron layout (its "
            "trainers in the Megatron image, the engines in the GPU image, one job)"
        ),
        # training on one node; the job's second node holds the 2 engines (hardware adds it)
        "hardware": Hardware(
            node_type="p5en.48xlarge", sft_nodes=1, grpo_nodes=1, storage_gib=8000
        ),
        "serving": P5EN_SERVING,
        # both GRPO branches: the form's backend parameter picks DeepSpeed or Megatron-Core
        "grpo_branches": ("hf", "megatron"),
        # verl's gpt-oss Megatron layout (TP 8, EP 8, PP = nodes) on the one 8x H200 node
        "megatron_layout": {"preset": "verl-gpt-oss-8x8-h100", "pp": 1},
        # the Megatron branch's optimizer, as verl's recipe runs it: full recompute of every
        # layer, the optimizer state and update on the host (the DeepSpeed branch's ZeRO-3 +
        # Adam offload and gradient checkpointing, in Megatron-Core's terms)
        "megatron_optim": {
            "learning_rate": 5e-7,
            "lr_scheduler": "constant",
            "warmup_steps": 5,
            "megatron": {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
                "optimizer_offload_fraction": 1.0,
            },
        },
        "grpo": GPT_OSS_20B.grpo.model_copy(
            update={
                # gpt-oss-20b's dedicated engines, one step off-policy (verl's decoupled
                # recipe: the engines sample step k+1 while step k trains)
                "rollout": GPT_OSS_20B.grpo.rollout.model_copy(update={"n_samples": 16}),
                "prompts_per_step": 16,
            }
        ),
    }
)

GPT_OSS_20B_LORA = Preset.model_validate(
    {
        **dict(GPT_OSS_20B),
        "name": "gpt-oss-20b-lora",
        "description": (
            "openai/gpt-oss-20b, LoRA GRPO on one p5en node (8 H200; ~46 GiB a GPU, so 8 "
            "H100 also hold it): a rank-16 adapter on attention and experts, the base frozen; "
            "DeepSpeed ZeRO-2, the HF engine on each training GPU samples with base + adapter "
            "(nothing to sync); SFT as gpt-oss-20b's on the same node"
        ),
        # SFT and GRPO each on the one node; colocated engines: no second node
        "hardware": Hardware(
            node_type="p5en.48xlarge", sft_nodes=1, grpo_nodes=1, storage_gib=2000
        ),
        "serving": P5EN_SERVING,
        "grpo": GPT_OSS_20B.grpo.model_copy(
            update={
                # the HF engine (vLLM's LoRA requests are not wired yet), colocated: each
                # training process samples its own prompts with the module it trains, base +
                # adapter, so no weights move between steps
                "rollout": GPT_OSS_20B.grpo.rollout.model_copy(
                    update={
                        "engine": "hf",
                        "tensor_parallel_size": 1,
                        "colocate": True,
                        "num_engines": 0,
                        "async_steps": 0,
                    }
                ),
                # attention and the 3-D expert weights (peft target_parameters): the experts
                # are 91% of the model's weights and where LoRA-for-RL studies put the adapter
                # (attention-only adapters trail full fine-tuning; all-layer ones match it)
                "lora": LoraSettings(r=16, alpha=32, experts=True),
                # ZeRO-2: each GPU holds the frozen bf16 base whole (39 GiB) so the HF engine
                # generates without gathering a layer per token; only the adapter's gradients
                # and Adam states exist, sharded over the 8 ranks; the KL reference is the base
                # with the adapter off. lr 10x full GRPO's (LoRA's optimum sits ~10x higher)
                "optim": OptimConfig(
                    backend="deepspeed",
                    zero_stage=2,
                    learning_rate=5e-6,
                    lr_scheduler="constant",
                    warmup_steps=5,
                ),
            }
        ),
    }
)

PRESETS: dict[str, Preset] = {
    p.name: p for p in (TINY_CPU, GPT_OSS_20B, GPT_OSS_20B_VERL, GPT_OSS_20B_LORA)
}
DEFAULT_PRESET = "tiny-cpu"
STEPS = (
    "data_prep",
    "model",
    "sft",
    "grpo",
    "eval",
    "gate",
    "hardware",
    "cluster",
    "megatron_layout",
    "megatron_optim",
)


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


def step_execution(
    preset: Preset, step: Step, platform: Mapping[str, Any] | None = None
) -> ExecutionConfig:
    """Where ``step`` trains (its ``<step>_execution`` parameter): in its pipeline pod, or as a
    job (TrainJob or PyTorchJob, ``preset.cluster``) of ``preset.hardware``'s nodes (GRPO's
    with the nodes of its dedicated rollout engines after the training ones) that takes the
    platform's workspace volume and Secrets: ``platform`` (the job's fields from the settings
    the pipeline was compiled with, ``platform.job_defaults``), else those of
    ``preset.hardware.platform``."""
    rollout_processes = preset.grpo.rollout_processes if step == "grpo" else 0
    execution = preset.hardware.execution(step, rollout_processes)
    if execution.mode == "local":
        return execution
    if platform is None:
        from pipelines.platform import get_platform, job_defaults

        platform = job_defaults(get_platform(preset.hardware.platform), step)
    job = {**platform, **config_dict(preset.cluster), **execution.job}
    return execution.model_copy(update={"job": job})


def training_runtime(preset: Preset, image: str) -> dict:
    """The ClusterTrainingRuntime (``preset.cluster.runtime``) that ``preset``'s TrainJobs
    reference: ``image``, and the platform's workspace volume at its mount.

    Raises:
        ValueError: ``preset`` trains in its pipeline pods (``hardware.node_type`` local).
    """
    execution = step_execution(preset, "sft")
    if execution.mode == "local":
        raise ValueError(
            f"preset {preset.name!r} trains in its pipeline pods (hardware.node_type local) "
            "and creates no TrainJob: pick a cluster preset, e.g. gpt-oss-20b"
        )
    from cluster.trainjob import build_training_runtime

    return build_training_runtime(execution.cluster_job(image, default_namespace="default"))


def run_plan(preset: Preset, **picks: Any) -> RunPlan:
    """The shape of ``preset``'s run (``plan.RunPlan``), with a run's ``picks``: ``backend``
    (the GRPO branch; default the preset's), ``megatron_checkpoint``, ``layout_overrides``,
    ``job_api``."""
    return RunPlan.resolve(config_dict(preset), picks)


def megatron_layout(preset: Preset) -> dict[str, Any]:
    """The Megatron branch's layout: the preset's parallel sizes on ``hardware``'s machines."""
    return dict(run_plan(preset).megatron_layout)


def grpo_branch_config(preset: Preset, backend: str | None = None):
    """The GRPO config the pipeline's ``backend`` branch (default: the preset's) runs for
    ``preset``, as the ``grpo`` component builds it (``plan.branch_config``):
    on ``megatron``, ``grpo`` with ``megatron_optim`` and ``megatron_layout`` (the checkpoint
    is ``convert_megatron``'s, known at run time).

    Raises:
        pydantic.ValidationError: the branch's config does not hold.
    """
    from trainer.grpo.config import GRPOConfig

    picks = {} if backend is None else {"backend": backend}
    return GRPOConfig.model_validate(run_plan(preset, **picks).grpo_config)


def megatron_grpo_config(preset: Preset):
    """The GRPO config of ``preset``'s Megatron branch (``-p backend=megatron``)."""
    return grpo_branch_config(preset, "megatron")


def step_configs(
    preset: Preset, job_platform: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, object]:
    """What the pipeline's steps take from ``preset``, by name: the ``configure`` step's
    outputs (``pipelines.run_form``), which the other steps read.

    ``data_source`` and ``model_source`` are the data and the base model (also inside
    ``data_prep`` and as ``base_model``'s source); the steps' configs and the machines'
    settings are dicts: ``hardware``, each training step's ``execution``
    (``step_execution``), the Megatron branch's ``megatron_layout`` on ``hardware``'s
    machines.
    """
    return {
        "data_source": preset.data_prep.source,
        "data_prep": config_dict(preset.data_prep),
        "model_source": preset.model.source,
        "tiny_config": config_dict(preset.model.tiny),
        "sft": config_dict(preset.sft),
        "grpo": config_dict(preset.grpo),
        "eval": config_dict(preset.eval),
        "gate": config_dict(preset.gate),
        "serving": config_dict(serving_config(preset)),
        "hardware": config_dict(preset.hardware),
        "layout_overrides": dict(preset.layout_overrides),
        "backend": preset.backend,
        "megatron_layout": megatron_layout(preset),
        "megatron_optim": dict(preset.megatron_optim),
        "sft_execution": config_dict(step_execution(preset, "sft", _platform(job_platform, "sft"))),
        "grpo_execution": config_dict(
            step_execution(preset, "grpo", _platform(job_platform, "grpo"))
        ),
    }


def serving_config(preset: Preset) -> ServingConfig:
    """``preset.serving`` with its GPUs resolved: where not given, the tensor parallel size
    of the preset's GRPO engines (they served this model on these machines)."""
    if preset.serving.gpus is not None:
        return preset.serving
    return preset.serving.model_copy(update={"gpus": preset.grpo.rollout.tensor_parallel_size})


def _platform(job_platform: Mapping[str, Mapping[str, Any]] | None, step: str):
    return None if job_platform is None else dict(job_platform.get(step, {}))


def job_platform_json(settings) -> str:
    """The training jobs' platform fields (``platform.job_defaults``: the workspace volume and
    its mount, the Secrets) of each training step, from the settings a pipeline is compiled
    with, as the JSON its ``configure`` step carries: the jobs mount the volume where the
    pipeline's pods do."""
    from pipelines.platform import job_defaults

    fields = {step: job_defaults(settings, step) for step in TRAINING_STEPS}
    return json.dumps(fields, sort_keys=True)


def preset_json(preset: Preset) -> str:
    """``preset`` as the JSON text its compiled pipeline carries (``preset_from_json`` reads
    back an equal preset): every value, keys sorted, except a training step's ``nproc``
    where ``hardware`` derives it (so a run's ``hardware`` override derives it again)."""
    data = preset.model_dump(mode="json")
    for step in TRAINING_STEPS:
        if "nproc" not in getattr(preset, step).model_fields_set:
            del data[step]["nproc"]
    return json.dumps(data, sort_keys=True)


def preset_from_json(text: str) -> Preset:
    """The preset ``preset_json`` wrote.

    Raises:
        pydantic.ValidationError: ``text`` is not a valid preset.
    """
    return Preset.model_validate_json(text)
