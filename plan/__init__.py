"""The plan of a run: what shape it has, stated once, that every layer above reads.

``RunPlan.resolve`` reads a preset's values once into the run's shape (``RunPlan``: the branch,
each training step's ``StepShape``, the engine, the machines, the job API). Below it:
``ParallelSizes`` (the one "layout": tp, pp, ep, etp, cp, dp) and the one set of rules a world
of processes must meet to hold them; the config a pipeline branch runs (``branch_config``); the
named Megatron layouts' fields and sizes (``megatron_sizes``); the rollout engines placement
reads (``RolloutEngines``); and the registries of the trainer backends (``TrainerSpec``,
``trainer_spec``), the rollout engines (``EngineSpec``, ``engine_spec``) and the job APIs
(``JobSpec``, ``job_spec``): the facts of each that the layers above read instead of comparing
names. It imports only ``core`` and ``cluster``'s machine facts.
"""

from plan.backends import (
    GRPO_BRANCHES,
    HF_BRANCH,
    MEGATRON_BRANCH,
    TRAINERS,
    TrainerSpec,
    branch_backend,
    trainer_spec,
)
from plan.branches import DEFAULT_MEGATRON_LAYOUT, branch_config
from plan.engines import ENGINE_SPECS, EngineSpec, engine_spec
from plan.jobs import JobSpec, job_spec
from plan.megatron_layouts import (
    MEGATRON_LAYOUT_PRESETS,
    MEGATRON_MACHINE_FIELDS,
    UnknownMegatronLayoutError,
    megatron_layout_fields,
    megatron_sizes,
)
from plan.parallel_sizes import ParallelSizes, ParallelSizesError
from plan.rollout import RolloutEngines, rollout_engines
from plan.run_plan import RunPlan, RunPlanError, StepShape
from plan.specs import UnknownSpecError

__all__ = [
    "DEFAULT_MEGATRON_LAYOUT",
    "ENGINE_SPECS",
    "GRPO_BRANCHES",
    "HF_BRANCH",
    "MEGATRON_BRANCH",
    "MEGATRON_LAYOUT_PRESETS",
    "MEGATRON_MACHINE_FIELDS",
    "TRAINERS",
    "EngineSpec",
    "JobSpec",
    "ParallelSizes",
    "ParallelSizesError",
    "RolloutEngines",
    "RunPlan",
    "RunPlanError",
    "StepShape",
    "TrainerSpec",
    "UnknownMegatronLayoutError",
    "UnknownSpecError",
    "branch_backend",
    "branch_config",
    "engine_spec",
    "job_spec",
    "megatron_layout_fields",
    "megatron_sizes",
    "rollout_engines",
    "trainer_spec",
]
