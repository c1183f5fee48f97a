"""``RunPlan``: the shape of a run, resolved once from a preset's values.

Which branch runs GRPO, which trainer backend each training step runs, which rollout engine,
how the policy is split (``ParallelSizes``), on which machines (``cluster.hardware.Hardware``)
and through which job API: ``RunPlan.resolve`` reads the preset's strings for all of it, and
the layers above read the plan's fields (``plan.grpo.trainer.model_parallel``,
``plan.engine.reserves_gpu_memory``, ``plan.grpo.sizes``) instead of deriving it again.

The plan sits below the trainer, so it takes the preset's values as plain data: a preset
dumped to JSON types (``Preset.model_dump(mode="json")``), or what the pipeline's steps take
from it (``pipelines.presets.step_configs``, the ``configure`` step's outputs). Both carry
every default of the configs, so nothing here restates one; the trainer validates the
branch's config (``GRPOConfig.model_validate(plan.grpo_config)``), and the rules between the
sizes and a world of processes stay where they are reported (placement, the capacity planner,
``GRPOConfig``), so the plan's ``sizes`` are not fitted to a world (``dp`` unset).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ExecutionConfig
from cluster.hardware import Hardware, Step
from cluster.jobs import AUTO
from cluster.nodes import rollout_nodes
from plan.backends import HF_BRANCH, TrainerSpec, trainer_spec
from plan.branches import branch_config
from plan.engines import EngineSpec, engine_spec
from plan.jobs import JobSpec, job_spec
from plan.megatron_layouts import megatron_sizes
from plan.parallel_sizes import ParallelSizes
from plan.rollout import RolloutEngines, rollout_engines
from plan.specs import whole


class RunPlanError(ValueError):
    """The preset's values lack a field the plan reads (the message names it)."""


@dataclass(frozen=True)
class StepShape:
    """One training step's shape: who trains, on which machines, split how.

    Attributes:
        trainer: its trainer backend.
        nodes: the nodes its training processes fill (a local run: one).
        gpus_per_node: its processes on each of them.
        training_processes: its training processes (the config's ``nproc``).
        sizes: how the policy is split over them (``dp`` not fitted).
        rollout: GRPO's rollout engines; None for SFT.
    """

    trainer: TrainerSpec
    nodes: int
    gpus_per_node: int
    training_processes: int
    sizes: ParallelSizes = field(default_factory=ParallelSizes)
    rollout: RolloutEngines | None = None

    @property
    def rollout_processes(self) -> int:
        """Processes of the dedicated rollout engines, beside the training ones."""
        return self.rollout.processes if self.rollout is not None else 0

    @property
    def job_nodes(self) -> int:
        """Nodes of the step's job: the training nodes, then the nodes the dedicated engines
        fill after them."""
        return self.nodes + rollout_nodes(self.rollout_processes, self.gpus_per_node)


@dataclass(frozen=True, eq=False)
class RunPlan:
    """The shape of a run (see the module docstring).

    Attributes:
        branch: the GRPO branch that runs (``hf``, or a trainer backend's name: ``megatron``).
        machines: the machines.
        sft: the SFT step's shape.
        grpo: the GRPO step's shape (its trainer is the branch's).
        engine: the GRPO rollout engine.
        job_api: the training jobs' API (``auto``: the API server's answer decides).
        sft_config: the SFT config, as given.
        grpo_config: the GRPO config the branch runs (``plan.branch_config``).
        megatron_layout: the Megatron layout on the machines (the Megatron branch's; the
            convert step's).
        layout_overrides: capacity-planner layout fields the configs do not decide.
    """

    branch: str
    machines: Hardware
    sft: StepShape
    grpo: StepShape
    engine: EngineSpec
    job_api: str
    sft_config: Mapping[str, Any]
    grpo_config: Mapping[str, Any]
    megatron_layout: Mapping[str, Any]
    layout_overrides: Mapping[str, str]

    @property
    def trainer(self) -> TrainerSpec:
        """The trainer backend of the branch's GRPO step."""
        return self.grpo.trainer

    @property
    def job(self) -> JobSpec | None:
        """The job API's spec; None where the machines are local or the API is ``auto``
        (only the API server's discovery says which: ``cluster.jobs.resolve_job_api``)."""
        if self.machines.local or self.job_api == AUTO:
            return None
        return job_spec(self.job_api)

    @classmethod
    def resolve(
        cls, preset: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
    ) -> RunPlan:
        """The plan of ``preset``'s values with a run's picks.

        Args:
            preset: the preset's values: ``sft`` and ``grpo`` (config dicts with their
                defaults, ``nproc`` derived from the machines), ``hardware``, and, when the
                preset has them, ``backend``, ``megatron_layout``, ``megatron_optim``,
                ``layout_overrides``, ``cluster`` (its ``job_api``), ``sft_execution`` and
                ``grpo_execution`` (where the steps' jobs run).
            overrides: what a run picks: ``backend`` (the branch: the run form's parameter),
                ``megatron_checkpoint`` (the convert step's output), ``layout_overrides``
                (after the preset's), ``job_api``.

        Raises:
            RunPlanError: a field the plan reads is missing.
            ValueError: a count or size that is not a whole number (KFP's floats are:
                ``plan.specs.whole``), or a job that leaves no node for training.
            UnknownSpecError: a trainer backend, rollout engine or job API that no registry
                holds.
            UnknownMegatronLayoutError: a Megatron layout that names an unknown preset.
        """
        picks = dict(overrides or {})
        branch = picks.get("backend") or preset.get("backend") or HF_BRANCH
        machines = Hardware.model_validate(preset.get("hardware") or {})
        grpo, sft = _field(preset, "grpo"), _field(preset, "sft")
        layout = {
            **(preset.get("megatron_layout") or {}),
            **machines.megatron_fields(whole(_field(grpo, "nproc", "grpo"), "grpo.nproc")),
        }
        grpo_config = branch_config(
            grpo,
            branch,
            layout,
            picks.get("megatron_checkpoint"),
            preset.get("megatron_optim") or None,
        )
        engine = engine_spec(_field(grpo_config, "rollout.engine", "grpo"), "grpo.rollout.engine")
        return cls(
            branch=branch,
            machines=machines,
            sft=_step(machines, "sft", sft, preset.get("sft_execution")),
            grpo=_step(machines, "grpo", grpo_config, preset.get("grpo_execution"), engine),
            engine=engine,
            job_api=picks.get("job_api") or _job_api(preset),
            sft_config=sft,
            grpo_config=grpo_config,
            megatron_layout=layout,
            layout_overrides={
                **(preset.get("layout_overrides") or {}),
                **(picks.get("layout_overrides") or {}),
            },
        )


def _field(values: Mapping[str, Any], path: str, where: str = "") -> Any:
    """``values[a][b]…`` for ``path`` ``a.b…``; ``RunPlanError`` naming the path if absent."""
    found: Any = values
    for key in path.split("."):
        if not isinstance(found, Mapping) or key not in found:
            name = f"{where}.{path}" if where else path
            raise RunPlanError(
                f"the preset's values have no {name}: pass the configs as they dump "
                "(Preset.model_dump(mode='json'), or pipelines.presets.step_configs)"
            )
        found = found[key]
    return found


def _step(
    machines: Hardware,
    step: Step,
    config: Mapping[str, Any],
    execution: Mapping[str, Any] | None,
    engine: EngineSpec | None = None,
) -> StepShape:
    """A training step's shape from its config (the branch's, for GRPO). Its nodes are its
    execution's where the values carry one (the configure step's outputs: a run form may
    change a job's nodes), else the machines'.

    Raises:
        ValueError: the execution's job leaves no node for training processes.
    """
    nproc = whole(_field(config, "nproc", step), f"{step}.nproc")
    trainer = trainer_spec(_field(config, "optim.backend", step), f"{step}.optim.backend")
    sizes = ParallelSizes()
    if trainer.model_parallel:
        sizes = megatron_sizes(_field(config, "optim.megatron.layout", step))
    rollout = None
    if engine is not None:
        settings = _field(config, "rollout", step)
        rollout = rollout_engines(
            engine.name,
            whole(settings["tensor_parallel_size"], "grpo.rollout.tensor_parallel_size"),
            settings["colocate"],
            whole(settings["num_engines"], "grpo.rollout.num_engines"),
        )
    if execution is None:
        nodes, per_node = machines.cluster(step, nproc)
    else:
        engines = rollout.processes if rollout is not None else 0
        nodes, per_node = ExecutionConfig.model_validate(execution).cluster(nproc, engines)
    return StepShape(trainer, nodes, per_node, nproc, sizes, rollout)


def _job_api(preset: Mapping[str, Any]) -> str:
    """The preset's job API: its ``cluster.job_api``, else the one its GRPO job states
    (``grpo_execution``, the configure step's output), else ``auto``."""
    stated = (preset.get("cluster") or {}).get("job_api")
    job = ((preset.get("grpo_execution") or {}).get("job") or {}).get("job_api")
    return stated or job or AUTO
