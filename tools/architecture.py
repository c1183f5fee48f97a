"""Write docs/architecture.md: the packages and who imports whom, read from the code
(``ast``, lazy imports included), as a Mermaid graph GitHub and most viewers draw.

    python tools/architecture.py            # rewrite docs/architecture.md
    python tools/architecture.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "architecture.md"
PACKAGES = {
    "pipelines": "the DAG, presets, the lingo CLI",
    "components": "one thin KFP component per step",
    "data_prep": "dataset → validated harmony JSONL",
    "trainer": "SFT, GRPO, backends, checkpoints, export",
    "capacity": "the capacity planner (lingo estimate)",
    "plan": "the shape of a run: RunPlan, ParallelSizes and its rules, backend/engine/job specs",
    "cluster": "machines, torchrun, TrainJobs and PyTorchJobs",
    "eval": "the eval, the gate, reports",
    "reward": "the reward scorer, its terms, adapters",
    "generation": "the engines of the eval and of GRPO: HF, vLLM, endpoints",
    "core": "what every step shares: languages, harmony, configs, tracking, S3",
}

VOCABULARY = [
    "## The plan of a run",
    "",
    "`plan.RunPlan.resolve(preset values, run picks)` reads a preset's strings once: the GRPO",
    "branch (`backend`: `hf` keeps the config's own trainer backend, `megatron` converts, trains",
    "on Megatron-Core and exports back; `plan.branch_config` is the branch's GRPO config), each",
    "training step's `StepShape` (its `TrainerSpec`, nodes and processes per node, from its",
    "execution where the pipeline passes one, else from the machines; its unfitted",
    "`ParallelSizes`, from the branch's Megatron layout (`plan.megatron_sizes`) or none; GRPO's",
    "`RolloutEngines` and the nodes its job takes), the `EngineSpec`, the machines",
    "(`cluster.hardware.Hardware`) and the job API. It takes the preset dumped to JSON types or",
    "the configure task's outputs (`pipelines.presets.run_plan`; the capacity-check task's",
    "`check_run`), restates no default, and the layers above read it: placement",
    "(`trainer.placement.step_placement`), the capacity check (`run_estimates`), the preflight",
    "(every model-parallel branch compiled), the run form and the rehearsal. The rules between",
    "the sizes and a world of processes stay where they are reported (placement, the planner,",
    "`GRPOConfig`); the trainer validates the branch's config (`GRPOConfig`).",
    "",
    "## Vocabulary",
    "",
    "One meaning each word. **layout** means parallel sizes only: how a run splits its model",
    "over processes (tp, pp, ep, etp, cp, dp), `plan.ParallelSizes`, which holds the one set of",
    "divisibility rules (Megatron-Core's two grids: world = tp × pp × cp × dp and",
    "world = etp × ep × expert-dp × pp). The machines a run uses, where its processes sit",
    "(placement) and what one rank's memory holds (the capacity estimate) are not its layout.",
    "The placement (`trainer.placement`) reads a run's `ParallelSizes` and its `RolloutEngines`",
    "(GPUs per engine, colocated or dedicated); the Megatron bridge reads `MegatronSizes`, a",
    "`ParallelSizes` with Megatron's two settings beside it (vpp, sequence parallelism).",
    "",
    "**backend** means the trainer backend (`OptimConfig.backend`: torch | deepspeed |",
    "megatron) and **engine** the rollout engine (`rollout.engine`: hf | vllm). Each has one",
    "spec in `plan/`: a `TrainerSpec` (`plan/backends.py`: ZeRO or a model-parallel split,",
    "whether it trains the Hugging Face module, runs several processes, its weight format and",
    "whether it needs conversion, its image) and an `EngineSpec` (`plan/engines.py`: GPUs per",
    "engine, whether it reserves its GPUs' memory, needs CUDA, serves LoRA, its weight-sync",
    "transports). Code outside `plan/` reads their fields",
    "(`trainer_spec(optim.backend).model_parallel`) instead of comparing names; an unknown",
    "name is one error naming the field and the valid names. Registering a backend is its",
    "spec (`TRAINERS`), its builder (`trainer.backends.BACKENDS`) and its name in",
    "`OptimConfig.backend`'s `Literal`; an engine is its spec (`ENGINE_SPECS`) and its",
    "builders (`trainer.grpo.engines.ENGINES`), and `rollout.engine` accepts what",
    "`ENGINE_SPECS` holds; `tests/plan/test_specs.py` checks they agree. A **job API** (the",
    "custom resource a training step runs as: `trainjob`, Kubeflow Trainer v2's TrainJob;",
    "`pytorchjob`, Training Operator v1's PyTorchJob; `cluster.job_api`) is a",
    "`cluster.jobs.JobKind`: its resource, conditions and pod labels, its manifest builder, the",
    "runtime of a job's own (two images) and the cluster runtime it references. It lives in",
    "`cluster` because `cluster` reads it below the plan (the launcher, the step job, the",
    "access rules, `auto`'s discovery); `plan.job_spec` looks one up for the layers above.",
    "The pipeline's `backend` parameter",
    "(`Preset.backend`) names a GRPO branch, `hf` or `megatron` (`plan.GRPO_BRANCHES`,",
    "`plan.branch_backend`), not",
    "a backend; the capacity planner's `Layout.backend` is deepspeed | megatron (it models",
    "torch as DeepSpeed stage 0 on one process). `tests/test_name_comparisons.py` counts the",
    "name comparisons left, under a ceiling that only goes down (now 0).",
    "",
    "**step** means a training step, what `max_steps` and the `step` of",
    "`training_metrics.jsonl` count: in SFT one optimizer step; in GRPO one batch of rollouts",
    "and its update (`ppo_epochs` × mini-batches optimizer steps inside it). A box of the",
    "pipeline is a **task** (KFP's word: data_prep, sft, grpo, evaluate, …). Names that users",
    "type or that a compiled pipeline carries keep the older word: `--set STEP.FIELD`,",
    "`Preset`'s step fields, `<task>_execution` parameters, `components/` (\"one component per",
    'step"); renaming them would break saved run forms, schedules and compiled pipelines, so',
    "they stay, and new code and docs say task.",
    "",
    "**share** is a fraction and says of what: `real_word_share` (of a text's words, those its",
    "language's word list knows), `known_word_share`, `prompt_copy_share`. The prompts a rank",
    "generates are **slots** of the step's batch: `engine_ranks` (the data-parallel ranks",
    "whose slots this rank's engine generates), `group_slots_request` and `rank_slots`",
    "(`trainer/grpo/rollout.py`).",
    "",
    "## Adding an engine, a policy loss or a job API",
    "",
    "Each is one definition and its registration; the config then names it and no other code",
    "changes. `tests/plan/test_extension.py` does all three in one file and runs a GRPO step",
    "and a step job through them.",
    "",
    "- **A rollout engine**: a class with the `RolloutEngine` protocol",
    "  (`trainer/grpo/rollout.py`: `submit`/`collect`/`generate`, `sync_weights`,",
    "  `token_log_probs`, `sleep`), its `EngineSpec` in `plan.ENGINE_SPECS` (GPUs per engine,",
    "  memory, CUDA, LoRA, weight-sync transports) and its `EngineBuilders` in",
    "  `trainer.grpo.engines.ENGINES` (colocated, rollout-only, which prompts it generates),",
    "  under the same name; then `rollout.engine: <name>`.",
    "- **A policy loss**: a function `loss(PolicyLossInputs, PolicyLossSettings) -> (loss,",
    "  stats)` (stats: `approx_kl`, `clip_fraction`, and with the engine's log-probs recorded",
    "  the rollout correction's, `trainer.grpo.update.CORRECTION_MEANS` and",
    "  `importance_ratio_max`) in `trainer.grpo.algorithm.POLICY_LOSSES`; then",
    "  `algorithm.policy_loss: <name>`.",
    "- **A job API**: a module with its manifest builder `build(name, layout, module, args) ->",
    "  dict` and a `JobKind` (resource, conditions, pod labels, `builder`, and the runtimes if",
    "  it has any) in `cluster.jobs.JOB_KINDS`; then `cluster.job_api: <name>`, and `auto` picks",
    "  it where the API server serves it.",
]


def imported_packages(path: Path, packages) -> set[str]:
    """The packages among ``packages`` that the module at ``path`` imports (lazy imports
    too; relative imports stay inside its own package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in packages}
    return found


def package_imports(package: str) -> Counter:
    """How many of ``package``'s modules import each other package."""
    counts: Counter = Counter()
    for path in sorted((ROOT / package).rglob("*.py")):
        counts.update(imported_packages(path, PACKAGES) - {package})
    return counts


def render() -> str:
    imports = {package: sorted(package_imports(package)) for package in PACKAGES}
    out = [
        "# Architecture: packages and their imports",
        "",
        "Generated from the code by `python tools/architecture.py` (a test fails when it is",
        "stale: a new arrow, or a package gone). An arrow `A --> B` means modules of A import B",
        "(lazy imports included). Imports go one way: `tests/test_import_direction.py` holds the",
        "allowed directions; docs/layout.md says what each package holds.",
        "",
        "```mermaid",
        "graph TD",
    ]
    for package, role in PACKAGES.items():
        out.append(f'    {package}["{package}/<br/>{role}"]')
    for package in PACKAGES:
        out += [f"    {package} --> {other}" for other in imports[package]]
    out += ["```", "", "| package | holds | imports |", "|---|---|---|"]
    for package, role in PACKAGES.items():
        names = ", ".join(f"`{o}`" for o in imports[package]) or "—"
        out.append(f"| `{package}/` | {role} | {names} |")
    out += ["", *VOCABULARY]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python tools/architecture.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
