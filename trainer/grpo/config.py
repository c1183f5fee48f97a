"""The typed configuration of the GRPO step, validated once at start (not at step 40).

``branch_config`` (the config a pipeline branch runs) is ``plan.branch_config``, imported here
for the GRPO component, whose compiled body imports it from this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from core.config_model import ConfigModel
from generation.requests import SamplingParams
from plan import branch_config as branch_config  # re-exported: the GRPO component imports it here
from plan import engine_spec, rollout_engines
from trainer.backends.config import OptimConfig, ProcessSettings
from trainer.grpo.algorithm import (
    get_advantage_estimator,
    get_kl_estimator,
    get_loss_agg_mode,
    get_policy_loss,
    get_rollout_correction,
)
from trainer.sft.config import LoraSettings


class RolloutConfig(ConfigModel):
    """How responses are sampled."""

    model_config = ConfigDict(extra="forbid")

    engine: str = "hf"
    """A rollout engine of ``plan.ENGINE_SPECS`` (its builders in ``trainer.grpo.engines``):
    ``hf`` (Hugging Face generate in the process) or ``vllm``."""
    n_samples: int = Field(8, ge=1)
    """Responses per prompt (the group size); at least 2 (see ``_a_group``)."""
    max_new_tokens: int = Field(256, ge=1)
    max_prompt_tokens: int = Field(1024, ge=8)
    """Longer prompts are dropped at load (counted)."""
    temperature: float = Field(1.0, gt=0)
    """The policy GRPO trains is ``softmax(logits / temperature)``: the engines sample from it
    and record its log-probs, the trainer scores the rollouts (policy, reference) with it
    (``micro_batch.Micro.temperature``); 1: the raw logits."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass of the rollouts; below 1, vLLM's recorded log-probs are the nucleus's
    renormalized ones (``vllm_rollout.VLLM_BEHAVIOUR_LOGPROBS``), the HF engine's and the
    trainer's are not."""
    # vLLM only
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    colocate: bool = True
    """Engines on the training processes' GPUs (hybrid: one engine per ``tensor_parallel_size``
    training processes; vLLM sleeps during updates); False: engines in rollout-only
    processes on devices of their own, weights pushed after each update (non-hybrid,
    ``trainer.grpo.remote``). See ``trainer.placement``."""
    num_engines: int = Field(0, ge=0)
    """Dedicated engines (``colocate: false``; OpenRLHF's ``--vllm_num_engines``), each on
    ``tensor_parallel_size`` devices after the training processes' (the HF engine: 1);
    colocated runs leave it 0."""
    async_steps: int = Field(0, ge=0, le=1)
    """0: on-policy (each step samples with the weights it then updates). 1: one step
    off-policy (verl's ``one_step_off_policy``, AReaL-style): the dedicated engines sample step
    ``k+1`` with step ``k``'s starting weights while step ``k`` trains, and the loss corrects
    the one-update gap with truncated importance sampling (``algorithm.tis_cap``). Needs
    dedicated engines (``colocate: false``), which work while the trainer trains; see
    ``trainer.grpo.producer``."""
    sync_bucket_mb: int = Field(64, ge=1)
    """vLLM engines: the weight sync loads the policy in buckets of at most this many MiB (a
    larger tensor is a bucket of its own); dedicated vLLM engines receive them on every TP
    worker straight from the trainer, the next bucket gathered while one is on the wire."""
    sync_budget_s: float | None = Field(None, gt=0)
    """The modeled time of one weight sync (``lingo estimate`` prints it: "weight sync per
    step"); each sync's ``sync_s`` is logged beside it (``sync_budget_s``), and the run warns
    once when a sync takes over twice as long. None: no budget."""
    start_timeout_s: int = Field(3600, ge=1)
    """Dedicated engines: how long the training and the rollout processes wait for each other
    to be ready (the engines built: vLLM at 20B loads, compiles and captures CUDA graphs; the
    policy loaded and partitioned) before their first collective, which would otherwise wait
    only its group's timeout (``collective_timeout_s``); past it the run stops naming the
    processes not ready."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """vLLM's cap on the tokens of one scheduler step (None: vLLM's default; on vLLM's CPU build
    at least ``max_prompt_tokens + max_new_tokens``, as prompts are never split there:
    ``generation.vllm.vllm_scheduling_kwargs``)."""
    sync_check_tokens: int = Field(256, ge=32)
    """Tokens of the probe (the first held-out prompts' last tokens) scored by the engine and
    by the policy after every weight sync (``trainer.grpo.sync_check``): enough for a mean
    and a 95th percentile that one flipped routing decision does not move."""
    sync_check_factor: float = Field(3.0, ge=1)
    """How many times the noise floor learned before the first sync (the engine loaded from
    the policy's own weights) later syncs may differ from the policy, on the mean and the
    95th percentile of the per-token log-prob differences; past it the run stops."""
    sync_check_tolerance: float | None = Field(None, gt=0)
    """The dtype floor added to each bound of the sync check (None: 1e-3 for a float32
    policy, 0.05 for bf16/fp16)."""
    max_mismatch_kl: float | None = Field(0.002, gt=0)
    """The gate on ``rollout_kl`` (the engine's log-probs of each step's tokens against the
    trainer's, ``trainer.grpo.mismatch``): a step may reach
    ``mismatch_floor_factor × floor + max_mismatch_kl``, the floor being the run's first
    step's value at the same staleness (on-policy: its kernel noise; one update stale,
    ``async_steps: 1``: that and one update's move); None: no gate (the metrics are logged
    all the same)."""
    mismatch_floor_factor: float = Field(3.0, ge=1)
    """How many times the first ``rollout_kl`` at its staleness a later step may reach
    (plus ``max_mismatch_kl``)."""
    mismatch_action: Literal["warn", "stop"] = "warn"
    """Past the gate: log a warning and go on, or stop the run."""

    @property
    def sampling(self) -> SamplingParams:
        """What the rollout engines sample with (``generation.requests.SamplingParams``)."""
        return SamplingParams(self.temperature, self.top_p, self.max_new_tokens)

    @field_validator("engine")
    @classmethod
    def _a_registered_engine(cls, engine: str) -> str:
        engine_spec(engine)  # UnknownSpecError (a ValueError) naming the valid ones
        return engine

    @field_validator("n_samples")
    @classmethod
    def _a_group(cls, n_samples: int) -> int:
        # GRPO's advantage is a sample's reward against its group's (both estimators centre on
        # the group mean): one sample is its own mean, every advantage 0, nothing to learn
        if n_samples < 2:
            raise ValueError(
                f"rollout.n_samples={n_samples}: GRPO compares the responses to one prompt with "
                "each other (the group), so a group of one has advantage 0 and the run cannot "
                "learn; use at least 2 (8 is usual)"
            )
        return n_samples

    @model_validator(mode="after")
    def _engines_match_placement(self) -> RolloutConfig:
        if not self.colocate and self.num_engines < 1:
            raise ValueError(
                "rollout.colocate=false puts the engines in processes of their own: set "
                "rollout.num_engines (≥ 1 engines of tensor_parallel_size devices each)"
            )
        if self.async_steps and self.colocate:
            raise ValueError(
                f"rollout.async_steps={self.async_steps} overlaps sampling with training, which "
                "needs engines on devices of their own: set rollout.colocate=false and "
                "rollout.num_engines (colocated engines share the training processes)"
            )
        if self.colocate and self.num_engines:
            raise ValueError(
                f"rollout.num_engines={self.num_engines} is for dedicated GPUs "
                "(colocate=false); colocated runs have one engine per tensor_parallel_size "
                "training processes"
            )
        return self


class DynamicSamplingConfig(ConfigModel):
    """DAPO's dynamic sampling (``trainer.grpo.dynamic_sampling``): refill the groups whose
    rewards are all equal (no signal) with groups of fresh prompts that have signal."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Off: the groups without signal stay in the batch (advantage 0; left out of the loss
    with ``filter_no_signal_groups``), as before the option."""
    max_resample_rounds: int = Field(3, ge=1)
    """The cap: at most this many rounds of ``prompts_per_step`` fresh prompts per step (each
    a generation as long as the step's own); slots still without signal after the last round
    stay as they are."""


class AlgorithmConfig(ConfigModel):
    """GRPO's loss (verl names)."""

    model_config = ConfigDict(extra="forbid")

    policy_loss: str = "ppo_clip"
    """``algorithm.POLICY_LOSSES``: ``ppo_clip`` (token ratios; the decoupled loss when the
    engine recorded its log-probs) or ``gspo`` (one ratio per sequence, clipped per sequence;
    its paper clips at ``clip_ratio_low: 0.0003``, ``clip_ratio_high: 0.0004``)."""
    advantage_estimator: str = "grpo"
    """``grpo`` (group mean and std) or ``dr_grpo`` (group mean only; Dr. GRPO pairs it with
    ``loss_agg_mode: seq-mean-token-sum-norm``, the sum over a constant normaliser)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong punishment (``algorithm.overlong_penalty``): responses longer than
    ``rollout.max_new_tokens − overlong_buffer`` tokens lose up to ``overlong_penalty_factor``
    reward as they near the limit; 0: off."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    clip_ratio_high: float = Field(0.28, ge=0)
    clip_ratio_c: float = Field(10.0, gt=1)
    tis_cap: float = Field(2.0, gt=1)
    """Truncation ``C`` of the importance weights of ``token_tis`` (``min(π_prox/μ, C)`` per
    token) and ``seq_tis`` (of the sequence's ratio) in ``algorithm.decoupled_policy_loss``."""
    rollout_correction: str | None = None
    """How the loss corrects the gap between the engine that sampled the rollouts (``μ``,
    whose log-probs it recorded) and the trainer's policy before the update (``π_prox``):
    ``none``, ``token_tis``, ``seq_tis`` or ``seq_mask`` (``algorithm.ROLLOUT_CORRECTIONS``),
    on every step, on-policy or stale. None: ``token_tis`` on stale steps
    (``rollout.async_steps: 1``) and ``none`` on on-policy ones, as before the option."""
    seq_mask_low: float = Field(0.999, gt=0, le=1)
    """``seq_mask`` drops a sequence whose geometric-mean ratio ``exp(mean_t log π_prox/μ)``
    is below this (verl's ``geo_rs`` preset: 1/1.001) … """
    seq_mask_high: float = Field(1.001, ge=1)
    """… or above this; the bounds of ``rollout_seq_beyond_mask_fraction`` too."""
    router_replay: Literal["off", "rollout"] = "off"
    """MoE models (GPT-OSS): ``rollout`` has the training forward route each token to the
    experts the rollout engine chose for it (``trainer.grpo.routing``), instead of its own
    top-k; the gate weights stay differentiable. ``off``: the trainer routes; the share of
    (token, layer) choices that differ is logged (``router_mismatch_rate``) when the engine
    records its routing."""
    loss_agg_mode: str = "token-mean"
    """``algorithm.LOSS_AGG_MODES``: ``token-mean`` (every token of the mini-batch alike),
    ``seq-mean-token-mean`` (each sequence's mean, then their mean; GRPO's paper),
    ``seq-mean-token-sum``, or ``seq-mean-token-sum-norm`` (Dr. GRPO: the sum over the
    constant ``sequences × rollout.max_new_tokens``)."""
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_estimator: str = "low_var_kl"
    entropy_coeff: float = Field(0.0, ge=0)
    ppo_epochs: int = Field(1, ge=1)
    filter_no_signal_groups: bool = True
    """Leave out of the update the groups whose rewards are all equal (zero advantage)."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """DAPO's dynamic sampling: re-sample fresh prompts until the step's batch holds
    ``prompts_per_step`` groups with signal, at most ``max_resample_rounds`` times."""

    @model_validator(mode="after")
    def _known_names(self) -> AlgorithmConfig:
        get_policy_loss(self.policy_loss)
        get_advantage_estimator(self.advantage_estimator)
        get_kl_estimator(self.kl_estimator)
        get_loss_agg_mode(self.loss_agg_mode)
        if self.rollout_correction is not None:
            get_rollout_correction(self.rollout_correction)
        return self


class GuardConfig(ConfigModel):
    """Against reward hacking: keep the best held-out policy whose text stays real."""

    model_config = ConfigDict(extra="forbid")

    max_real_word_drop: float = Field(0.10, ge=0, le=1)
    """A policy whose held-out real-word share falls more than this fraction below the
    starting model's is not kept (the reward cannot see made-up words)."""
    keep_best: bool = True
    """Export the best held-out checkpoint under the guard rather than the last one."""
    min_reasoning_length_ratio: float = Field(0.5, ge=0, le=1)
    """A policy whose held-out median reasoning length (overall or in any language) falls below
    this share of the SFT model's on the same prompts has collapsed its reasoning (issue #43:
    4-7 words after GRPO against SFT's 10-16): it is flagged (``eval_reasoning_collapsed``) and
    not kept as the best; 0: never."""
    reasoning_collapse: Literal["flag", "stop"] = "flag"
    """On a collapse: ``flag`` (a warning, the run goes on) or ``stop`` the run."""
    max_loop_rate: float = Field(1.0, ge=0, le=1)
    """A policy whose held-out loop rate (``reward.outcome.Outcome.loop``: a repetition loop,
    a stopword salad or a copy of the question), overall or in any language, is above this
    share is not kept as the best (flagged: ``eval_looping``); 1: never. The reward already
    scores a loop as the wrong language, but a policy can raise its mean reward while a
    language loops more (issue #43: the demo's Spanish, 0.06 at the eval's temperature)."""

    @property
    def stops_on_collapse(self) -> bool:
        """Whether a reasoning collapse ends the run (``reasoning_collapse: stop``)."""
        return self.reasoning_collapse == "stop"


class GRPOConfig(ProcessSettings):
    """How the GRPO step trains.

    One step: ``prompts_per_step`` prompts × ``rollout.n_samples`` responses, updated in
    mini-batches of ``mini_batch_size`` sequences (``ppo_epochs`` passes), each mini-batch
    accumulated over micro-batches of ``micro_batch_size`` sequences per process.
    """

    model_config = ConfigDict(extra="forbid")

    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    guard: GuardConfig = GuardConfig()
    optim: OptimConfig = OptimConfig(learning_rate=1e-6, lr_scheduler="constant")
    lora: LoraSettings = LoraSettings(r=0)
    """LoRA GRPO (``trainer.grpo.lora``): ``r > 0`` trains a peft adapter of rank ``r`` on
    ``target_modules`` (and, ``experts: true``, GPT-OSS's 3-D expert weights), the base frozen;
    each weight sync moves only the adapter's tensors and the export merges it into the base
    (SFT's checked merge). ``r = 0`` (the default): full-parameter GRPO. HF rollout engines
    and the torch and DeepSpeed backends only, for now."""
    merge_check_prompts: int = Field(4, ge=1)
    """LoRA: held-out prompts on which the merged export's logits are checked against base +
    adapter (``trainer.sft.merge``)."""
    reward_weights: dict[str, float] = Field(default_factory=dict)
    """Overrides of reward.scoring.RewardWeights fields (reference defaults otherwise)."""
    prompt_filter: Literal["all", "in-language"] = "all"
    """Which prompts of the train and held-out splits GRPO uses: ``all``, or ``in-language``
    (only questions written in the language they ask the reasoning and answer in — the
    deployed task; see docs/data_prep.md for which rows those are)."""
    prompts_per_step: int = Field(8, ge=1)
    mini_batch_size: int = Field(64, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    max_steps: int = Field(100, ge=1)
    eval_every: int = Field(10, ge=0)
    eval_prompts: int = Field(64, ge=1)
    eval_samples: int = Field(2, ge=1)
    checkpoint_every: int = Field(0, ge=0)
    max_ckpt_num: int = Field(2, ge=1)

    @property
    def rollout_processes(self) -> int:
        """Rollout-only processes started beside the ``nproc`` training processes: 0 when the
        engines are colocated, else ``num_engines × tensor_parallel_size`` (1 per HF
        engine)."""
        rollout = self.rollout
        return rollout_engines(
            rollout.engine, rollout.tensor_parallel_size, rollout.colocate, rollout.num_engines
        ).processes

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> GRPOConfig:
        limit = self.rollout.max_new_tokens
        if self.algorithm.overlong_buffer >= limit:
            raise ValueError(
                f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} must be below "
                f"rollout.max_new_tokens={limit} (the penalty ramps over the last "
                "overlong_buffer tokens before the limit)"
            )
        return self

    @model_validator(mode="after")
    def _router_replay_on_hf_modules(self) -> GRPOConfig:
        if self.algorithm.router_replay != "off" and not self.optim.trainer.trains_hf_module:
            raise ValueError(
                "algorithm.router_replay=rollout replays the engine's expert choices through a "
                "hook on the Hugging Face GPT-OSS router, which the Megatron backend does not "
                "run (its MoE layers route in Megatron-Core, whose router replay is not wired "
                "here yet); use optim.backend torch or deepspeed, or router_replay=off"
            )
        return self

    @model_validator(mode="after")
    def _lora_where_it_runs(self) -> GRPOConfig:
        if not self.lora.r:
            return self
        if not self.optim.trainer.trains_hf_module:
            raise ValueError(
                f"grpo.lora.r={self.lora.r}: LoRA GRPO trains a peft adapter on the Hugging Face "
                "module, which the Megatron backend does not train; use optim.backend torch or "
                "deepspeed, or lora.r=0"
            )
        if not engine_spec(self.rollout.engine).serves_lora:
            raise ValueError(
                f"grpo.lora.r={self.lora.r}: the vLLM rollout engine does not serve the adapter "
                "yet (its LoRA requests are not wired here); use rollout.engine=hf, or lora.r=0"
            )
        return self

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> GRPOConfig:
        replicas, what = self.nproc, f"nproc {self.nproc}"
        if self.optim.trainer.model_parallel:
            replicas = _megatron_data_parallel(self)
            what = f"the Megatron data-parallel size {replicas}"
        rollouts = self.prompts_per_step * self.rollout.n_samples
        if rollouts % self.mini_batch_size:
            raise ValueError(
                f"prompts_per_step × n_samples = {rollouts} is not a multiple of "
                f"mini_batch_size {self.mini_batch_size}"
            )
        if self.mini_batch_size % (self.micro_batch_size * replicas):
            raise ValueError(
                f"mini_batch_size {self.mini_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size} × {what}"
            )
        if self.prompts_per_step % replicas:
            raise ValueError(
                f"prompts_per_step {self.prompts_per_step} is not a multiple of {what}"
            )
        return self


def _megatron_data_parallel(cfg: GRPOConfig) -> int:
    """The data-parallel size of a Megatron run, after the checks that need no model config.

    The layout's world (``nodes × gpus_per_node``) must be the job's (``nproc``) and hold its
    parallel sizes (``plan.ParallelSizes``'s rules); the rules between the layout and the
    model's shapes run at start (``validate_layout``), before any weight is loaded.
    """
    settings = cfg.optim.megatron
    layout = settings.resolved_layout()
    world = layout.nodes * layout.gpus_per_node
    problems = []
    if cfg.nproc != world:
        problems.append(
            f"nproc={cfg.nproc} but layout {layout.name!r} runs on nodes × gpus_per_node = "
            f"{layout.nodes} × {layout.gpus_per_node} = {world} processes; make them equal"
        )
    problems += layout.parallel_sizes.problems(world, f"layout {layout.name!r}'s world")
    if layout.cp != 1:
        problems.append(
            f"cp={layout.cp}: the GRPO Megatron backend runs cp=1 (context parallelism needs "
            "each row split into 2·cp chunks and the response log-probs gathered back, which "
            "it does not do); verl's gpt-oss recipe uses cp=1"
        )
    if cfg.gradient_checkpointing:
        problems.append(
            "gradient_checkpointing is the Hugging Face model's switch; with backend=megatron "
            "set optim.megatron.recompute_granularity (e.g. full, uniform, 1 layer)"
        )
    if problems:
        raise ValueError("optim.backend=megatron: " + "; ".join(problems))
    return world // layout.parallel_sizes.model_parallel
