"""``lingo rehearse``: a cluster preset's compiled pipeline, run whole on this machine in the
shape a cluster runs it (issue #39).

1. The preset, with what a CPU cannot hold substituted (``substitutions``: a scaled-down GPT-OSS
   of the same architecture, the bundled data, few steps, the HF engine for vLLM), and each
   substitution recorded.
2. Compiled with the preset's platform (``pipelines.platform``), its workspace volume mounted
   at a local directory.
3. The compiled IR run by ``kfp.local``'s DAG orchestrator, but each task as its pod would
   run: the executor's container command, its env, the platform's Secrets as env
   (``secretAsEnv``), the workspace PVC, the image's Python (``RehearsalPod``).
4. The training steps create their TrainJobs through the Kubernetes client, as on a cluster
   (``cluster.step_job``), against ``cluster.local_cluster``: a local API and a controller
   that expands each TrainJob into a JobSet and its pods (the ``PET_*`` env the Trainer sets)
   and runs each pod as a local process group, gloo for NCCL.
5. Checks a cluster would fail later (``checks``): each rank's ``OMP_NUM_THREADS`` against its
   node's CPUs, OpenShift AI's primary-pod rule on each job's pods, whether the GRPO
   mismatch gate evaluated any step.

The report (``RehearsalReport.table``): per task and per job, what ran, what was
substituted, the result; then the checks and every substitution.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipelines.overrides import apply_overrides
from pipelines.presets import Preset, get_preset, job_platform_json, run_plan, step_configs
from plan import engine_spec, job_spec

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MEGATRON_PYTHON = REPO_ROOT / ".venv-megatron" / "bin" / "python"
MEGATRON_CPU_LAYOUT = {
    "tp": 1, "pp": 1, "ep": 1, "sequence_parallel": False, "params_dtype": "fp32",
}  # fmt: skip
"""The Megatron layout a CPU trains: TP > 1 on MoE needs Transformer Engine, and EP > 1's
all-to-all dispatcher copies on a CUDA stream (``tests/megatron/cpu_patches.py``, patch 6); the
training processes stay the preset's, as data-parallel ranks."""
MEGATRON_SITE = """\
# Written by lingo rehearse: the Megatron image's processes on a CPU (no Transformer Engine,
# no CUDA) get the test-only patches tests/megatron/cpu_patches.py and
# tests/megatron/test_megatron_grpo_step.py document, patch by patch, for the whole process.
import contextlib
import sys

sys.path[:0] = [{megatron_tests!r}, {tests!r}, {root!r}]
import cpu_patches  # noqa: E402

cpu_patches.import_megatron_bridge()
from test_megatron_grpo_step import training_cpu_patches  # noqa: E402

_LINGO_REHEARSAL_PATCHES = contextlib.ExitStack()
_LINGO_REHEARSAL_PATCHES.enter_context(cpu_patches.cpu_patches())
_LINGO_REHEARSAL_PATCHES.enter_context(training_cpu_patches())
"""

POD_THREAD_LIMIT = 1
"""OpenMP threads a job pod's process runs here (``LocalCluster.thread_limit``): the verl
preset's 16 ranks of 22 threads on a 2-core machine spent most of the GRPO job's time waiting
at parallel regions (a rehearsal step: ~80 s)."""

SCALED_MODEL = {
    # gpt-oss-20b: 24 layers alternating sliding-window (128) and full attention, 64 query
    # heads over 8 KV heads of 64 dims, attention sinks, 32 experts, top-4 routing, YaRN RoPE.
    # The same layer types at a CPU's size, every count divisible by the presets' parallel
    # sizes (TP 8: heads and KV heads; EP 8: experts).
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 4,
    "sliding_window": 32,
}


@dataclass(frozen=True)
class Substitution:
    """What the rehearsal ran in place of what the preset names, and why."""

    what: str
    preset: str
    rehearsal: str
    why: str

    def line(self) -> str:
        return f"{self.what}: {self.preset} → {self.rehearsal} ({self.why})"


def substitutions(preset: Preset) -> tuple[dict[str, str], list[Substitution]]:
    """The overrides (``apply_overrides``) that fit ``preset`` on a CPU, and what each
    replaces. The machines (``hardware``: nodes, processes per node) are kept."""
    grpo, rollout = preset.grpo, preset.grpo.rollout
    # two micro-batches a rank in each mini-batch (gradient accumulation still runs): ZeRO-3
    # gathers the weights at each micro-batch's forward and backward, so their count is most
    # of a CPU step's time (the verl job's first step: 1,078 of 1,136 s in training at
    # micro-batch 1, 32 a rank)
    micro = max(1, grpo.mini_batch_size // (2 * grpo.nproc))
    overrides: dict[str, str] = {
        "model.source": "tiny",
        **{f"model.tiny.{k}": json.dumps(v) for k, v in SCALED_MODEL.items()},
        "data_prep.source": "bundled",
        "sft.max_steps": "2",
        "sft.max_seq_len": "384",
        "sft.gradient_accumulation_steps": "1",
        "sft.eval_every": "0",
        "sft.checkpoint_every": "0",
        "sft.eval_max_examples": str(preset.sft.nproc),
        "sft.dtype": "float32",
        "grpo.max_steps": "3",
        "grpo.prompts_per_step": str(grpo.nproc),
        "grpo.micro_batch_size": str(micro),
        "grpo.eval_every": "0",
        "grpo.checkpoint_every": "0",
        "grpo.rollout.max_new_tokens": "16",
        "grpo.rollout.max_prompt_tokens": "512",
        "grpo.dtype": "float32",
        "eval.limit": "4",
        "eval.sampling.n": "1",
        "eval.sampling.max_tokens": "16",
        "eval.dtype": "float32",
    }
    subs = [
        Substitution(
            "model",
            preset.model.source,
            "tiny GPT-OSS " + ", ".join(f"{k}={v}" for k, v in SCALED_MODEL.items()),
            "the same layer types (MoE router, sinks, sliding window); sizes a CPU trains",
        ),
        Substitution("data", preset.data_prep.source, "bundled", "no network"),
        Substitution(
            "SFT length",
            f"{preset.sft.max_steps or preset.sft.num_epochs} steps/epochs, seq "
            f"{preset.sft.max_seq_len}, accumulation {preset.sft.gradient_accumulation_steps}",
            f"2 steps, seq 384, accumulation 1; final eval loss on {preset.sft.nproc} examples",
            "a rehearsal, not a run; one eval example a rank still runs the final evaluation "
            f"(its {preset.sft.eval_max_examples} examples: ~9 of the verl SFT job's 12 min)",
        ),
        Substitution(
            "GRPO length",
            f"{grpo.max_steps} steps of {grpo.prompts_per_step} prompts, "
            f"{rollout.max_new_tokens} new tokens, micro-batch {grpo.micro_batch_size}",
            f"3 steps of {grpo.nproc} prompts (one a training rank), 16 new tokens, "
            f"micro-batch {micro}",
            "a rehearsal; 3 steps so one-step-off-policy has on- and off-policy steps; the "
            "preset's samples a prompt and mini-batch, so each step still takes "
            f"{grpo.nproc * rollout.n_samples // grpo.mini_batch_size} optimizer steps of 2 "
            "micro-batches a rank",
        ),
        Substitution("eval", "50 questions", "4 questions, 1 sample, 16 tokens", "a rehearsal"),
        Substitution("dtype", "bfloat16", "float32", "CPU"),
    ]
    if engine_spec(rollout.engine).needs_cuda:
        engines = rollout.num_engines * rollout.tensor_parallel_size if not rollout.colocate else 0
        overrides["grpo.rollout.engine"] = "hf"
        overrides["grpo.rollout.tensor_parallel_size"] = "1"
        if engines:
            overrides["grpo.rollout.num_engines"] = str(engines)
        subs.append(
            Substitution(
                "rollout engine",
                f"vLLM, {rollout.num_engines} engines × TP {rollout.tensor_parallel_size}",
                f"HF engine × {engines}, one per process" if engines else "HF engine",
                "vLLM needs CUDA; the same rollout-only processes and pods",
            )
        )
    return overrides, subs


@dataclass
class TaskRecord:
    """One pipeline task run as its pod."""

    task: str
    image: str
    python: str
    command: str
    returncode: int | None = None
    seconds: float = 0.0
    log_path: Path | None = None
    substituted: list[str] = field(default_factory=list)


@dataclass
class Check:
    """One check a cluster would fail later; ``passed`` None: could not be evaluated."""

    name: str
    passed: bool | None
    detail: str


@dataclass
class RehearsalReport:
    """What ran, what was substituted, what failed."""

    preset: str
    backend: str
    tasks: list[TaskRecord]
    not_run: list[str]
    pods: list
    checks: list[Check]
    substitutions: list[Substitution]
    output_dir: Path
    seconds: float

    @property
    def passed(self) -> bool:
        return all(t.returncode == 0 for t in self.tasks) and all(
            c.passed is not False for c in self.checks
        )

    def table(self) -> str:
        rows = [("step", "what ran", "substituted", "result")]
        for task in self.tasks:
            result = "ok" if task.returncode == 0 else f"FAILED (exit {task.returncode})"
            rows.append((task.task, task.command, "; ".join(task.substituted), result))
            for pod in [p for p in self.pods if p.job.startswith(f"lingo-{_job_step(task)}-")]:
                result = "ok" if pod.returncode == 0 else f"FAILED (exit {pod.returncode})"
                what = f"  pod {pod.name}: {pod.nproc_per_node} ranks, " + " ".join(
                    pod.command[1:4]
                )
                rows.append(("", what, "; ".join(pod.substituted), result))
        rows += [(name, "not run (its branch or condition)", "", "-") for name in self.not_run]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [
            f"lingo rehearse --preset {self.preset} -p backend={self.backend}: "
            f"{'PASSED' if self.passed else 'FAILED'} in {self.seconds:.0f} s "
            f"({self.output_dir})",
            "",
        ]
        for row in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
            )
        lines += ["", "checks:"]
        for check in self.checks:
            mark = {True: "ok", False: "FAILED", None: "not evaluated"}[check.passed]
            lines.append(f"  {check.name}: {mark}: {check.detail}")
        lines += ["", "substitutions:"]
        lines += [f"  {s.line()}" for s in self.substitutions]
        failed = [t for t in self.tasks if t.returncode != 0]
        for task in failed:
            pods = [p for p in self.pods if p.job.startswith(f"lingo-{_job_step(task)}-")]
            errors = [e for p in pods if p.returncode for e in _errors(p.log_path)]
            if errors:
                lines += ["", f"{task.task} failed; its pods' first errors:"]
                lines += [f"  {line}" for line in dict.fromkeys(errors)]
            else:
                lines += ["", f"{task.task} failed; the last lines of {task.log_path}:"]
                lines += [f"  {line}" for line in _tail(task.log_path, 15)]
        return "\n".join(lines)


def _job_step(task: TaskRecord) -> str:
    return "grpo" if task.task.startswith("grpo") else task.task


def _errors(path: Path | None, limit: int = 3) -> list[str]:
    """A failed pod's first error lines (a rank's ``error:`` line, an exception's last line),
    not the launcher's traceback that follows them."""
    if path is None or not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        text = line.strip()
        if text.startswith("error:") or (
            ("Error: " in text or "Exception: " in text) and not text.startswith("File ")
        ):
            found.append(text[:400])
        if len(found) >= limit:
            break
    return found


def _tail(path: Path | None, lines: int) -> list[str]:
    if path is None or not path.exists():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


def rehearsal_preset(name: str, backend: str | None = None) -> tuple[Preset, list[Substitution]]:
    """The preset ``name`` (``backend``: its GRPO branch) as the rehearsal runs it."""
    preset = get_preset(name)
    if preset.hardware.local:
        raise ValueError(
            f"preset {name!r} runs on this machine already (lingo run --local); rehearse a "
            "cluster preset: gpt-oss-20b, gpt-oss-20b-verl"
        )
    if backend is not None:
        preset = Preset.model_validate({**dict(preset), "backend": backend})
    overrides, subs = substitutions(preset)
    if run_plan(preset).trainer.model_parallel:
        preset, layout_sub = megatron_cpu_layout(preset)
        subs.append(layout_sub)
    return apply_overrides(preset, overrides), subs


def megatron_cpu_layout(preset: Preset) -> tuple[Preset, Substitution]:
    """The Megatron branch's layout as a CPU trains it (``MEGATRON_CPU_LAYOUT``): the same
    training processes, data-parallel."""
    from trainer.megatron.layout import resolve_megatron_layout

    layout = resolve_megatron_layout(preset.megatron_layout)
    changed = {k: v for k, v in MEGATRON_CPU_LAYOUT.items() if getattr(layout, k) != v}
    preset = Preset.model_validate(
        {**dict(preset), "megatron_layout": {**preset.megatron_layout, **changed}}
    )
    before = ", ".join(f"{k} {getattr(layout, k)}" for k in changed)
    after = ", ".join(f"{k} {v}" for k, v in changed.items())
    return preset, Substitution(
        "Megatron layout",
        f"{layout.name}: {before}",
        f"{after} (the {preset.grpo.nproc} training processes data-parallel)",
        "TP > 1 on MoE needs Transformer Engine; EP > 1's all-to-all dispatcher needs a CUDA "
        "stream (tests/megatron/cpu_patches.py patch 6)",
    )


def megatron_cpu_python(root: Path) -> Path:
    """A Python for the Megatron image on this CPU: ``.venv-megatron``'s, every process of it
    with the test-only CPU patches (``MEGATRON_SITE``, a ``sitecustomize`` on its
    ``PYTHONPATH``; the ranks torchrun and Megatron's checkpoint writers start inherit it).

    Raises:
        RuntimeError: ``.venv-megatron`` is missing or lacks the project's dependencies.
    """
    if not megatron_env_has_project():
        raise RuntimeError(
            f"rehearse --backend megatron: {MEGATRON_PYTHON} must have megatron-core, "
            "megatron-bridge, the project's dependencies and its cluster extra (as the Megatron "
            "image: .[megatron,cluster]); run: bash tools/megatron_env.sh --with-project"
        )
    site = root / "megatron-site"
    site.mkdir(parents=True, exist_ok=True)
    tests = REPO_ROOT / "tests"
    text = MEGATRON_SITE.format(
        megatron_tests=str(tests / "megatron"), tests=str(tests), root=str(REPO_ROOT)
    )
    (site / "sitecustomize.py").write_text(text)
    python = root / ".venv-megatron-cpu" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec {MEGATRON_PYTHON} "$@"\n'
    )
    python.chmod(0o755)
    return python


def rehearsal_secrets(tracking_uri: str) -> dict[str, dict[str, str]]:
    """The Secrets the platform names (``pipelines.platform.DEFAULT_SECRETS``), with values
    for this machine: MLflow to the rehearsal's SQLite store, no S3 or hub credentials."""
    from pipelines.platform import DEFAULT_SECRETS

    values = {"MLFLOW_TRACKING_URI": tracking_uri}
    return {
        s.secret_name: {key: values.get(key, "") for key in s.key_to_env} for s in DEFAULT_SECRETS
    }


def megatron_env_has_project(python: Path | None = None) -> bool:
    """Whether ``python`` (``.venv-megatron``'s) can run the project's steps as the Megatron
    image does: the image installs ``.[megatron,cluster]``, so kfp's executor, mlflow and the
    cluster clients import there. ``make test-megatron`` builds the env without them
    (``tools/megatron_env.sh``; ``--with-project`` adds them)."""
    python = python or MEGATRON_PYTHON
    modules = "kfp, mlflow, megatron.core, kubeflow.training, kubeflow_trainer_api"
    if not python.exists():
        return False
    return (
        subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True).returncode
        == 0
    )


def image_pythons() -> dict[str, str]:
    """Each image → the Python that runs its containers here (the project's venvs).

    The Megatron image → ``.venv-megatron`` when that env holds the project (as the image
    does), else the project's own venv: the DeepSpeed branch runs only ``export-hf`` in that
    image, and it needs the project's dependencies, not Megatron's."""
    from components.images import CPU_IMAGE, GPU_IMAGE, MEGATRON_IMAGE

    megatron = str(MEGATRON_PYTHON) if megatron_env_has_project() else sys.executable
    return {CPU_IMAGE: sys.executable, GPU_IMAGE: sys.executable, MEGATRON_IMAGE: megatron}


def compile_rehearsal(
    preset: Preset, output: Path, workspace: Path
) -> tuple[dict, dict, dict, dict]:
    """Compile ``preset`` with its platform, the workspace volume mounted at ``workspace`` (in
    the pipeline's pods and, through the ``configure`` step's compiled-in job platform, in the
    training jobs' pods); returns (pipeline spec, platform spec, the run's arguments, the
    steps' configs as its ``configure`` step gives them)."""
    from kfp import compiler

    from pipelines.pipeline import build_pipeline
    from pipelines.platform import get_platform
    from pipelines.run_form import form_arguments

    settings = get_platform(preset.hardware.platform)
    settings = settings.model_copy(update={"workspace_mount": str(workspace)})
    compiler.Compiler().compile(build_pipeline(preset, settings), str(output))
    spec, platform = yaml.safe_load_all(output.read_text())
    configs = step_configs(preset, json.loads(job_platform_json(settings)))
    return spec, platform, form_arguments(preset), configs


class _PodRunner:
    """Runs each kfp.local task as its pod would run (installed as kfp.local's subprocess
    task handler while the rehearsal runs)."""

    def __init__(
        self, spec: dict, platform: dict, env: dict[str, str], secrets, logs: Path, pythons
    ):
        self.executors = spec["deploymentSpec"]["executors"]
        self.platform = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
        self.env, self.secrets, self.logs = env, secrets, logs
        self.pythons = pythons
        self.records: list[TaskRecord] = []

    def executor_of(self, command: list[str]) -> str:
        """The executor label of a kfp.local command: ``exec-<its task directory>``."""
        label = f"exec-{_task_root(command)}"
        if label not in self.executors:
            raise RuntimeError(f"kfp.local ran a task of no executor in the IR: {label}")
        return label

    def run(self, command: list[str], env_vars: dict[str, str]) -> int:
        label = self.executor_of(command)
        task = label.removeprefix("exec-")
        container = self.executors[label]["container"]
        image = resolve_image(container["image"], command)
        python = self.pythons.get(image, sys.executable)
        substituted = [f"image → {Path(python).parent.parent.name}"]
        env = {**self.env, **env_vars}
        platform = self.platform.get(label, {})
        for secret in platform.get("secretAsEnv", []):
            data = self.secrets.get(secret["secretName"], {})
            for pair in secret["keyToEnv"]:
                env[pair["envVar"]] = data.get(pair["secretKey"], "")
        for mount in platform.get("pvcMount", []):
            if not Path(mount["mountPath"]).is_dir():
                raise RuntimeError(f"{task}: PVC {mount['constant']} at {mount['mountPath']}")
            substituted.append(f"PVC {mount['constant']} → {mount['mountPath']}")
        command = [part.replace("python3", python) for part in command]
        record = TaskRecord(task, image, python, "kfp executor_main", substituted)
        record.log_path = self.logs / f"{task}.log"
        self.records.append(record)
        started = time.monotonic()
        with record.log_path.open("wb") as out:
            process = subprocess.Popen(
                command, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            record.returncode = process.wait()
        record.seconds = time.monotonic() - started
        log.info("%s: exit %s in %.0f s", task, record.returncode, record.seconds)
        return record.returncode


def resolve_image(image: str, command: list[str]) -> str:
    """The image a task's pod runs: its executor's ``image``, where that is a placeholder of
    a pipeline parameter (``{{$.inputs.parameters['pipelinechannel--megatron_image']}}``:
    the images are run parameters) the value the task got, from its executor input."""
    match = re.fullmatch(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}", image)
    if match is None:
        return image
    executor_input = json.loads(command[command.index("--executor_input") + 1])
    values = executor_input.get("inputs", {}).get("parameterValues", {})
    if match.group(1) not in values:
        raise RuntimeError(f"the task's image {image} names no parameter it was given")
    return str(values[match.group(1)])


def _task_root(command: list[str]) -> str:
    """The task a kfp.local command is for: its executor input's output directory
    (``<pipeline_root>/<run>/<task>/…``)."""
    executor_input = json.loads(command[command.index("--executor_input") + 1])
    outputs = executor_input.get("outputs", {})
    file = outputs.get("outputFile") or ""
    return Path(file).parent.name


@contextlib.contextmanager
def _pods_as_handler(runner: _PodRunner) -> Iterator[None]:
    from kfp.local import status, subprocess_task_handler

    original = subprocess_task_handler.SubprocessTaskHandler

    class PodTaskHandler(original):
        def run(self) -> status.Status:
            code = runner.run(list(self.full_command), dict(self.env_vars))
            return status.Status.SUCCESS if code == 0 else status.Status.FAILURE

    subprocess_task_handler.SubprocessTaskHandler = PodTaskHandler
    try:
        yield
    finally:
        subprocess_task_handler.SubprocessTaskHandler = original


def rehearse(
    preset_name: str, output_dir: Path, backend: str | None = None, job_api: str = "trainjob"
) -> RehearsalReport:
    """Run ``preset_name``'s compiled pipeline as a cluster would, on this machine (its
    cluster serving ``job_api``: ``trainjob`` or ``pytorchjob``)."""
    from core.tracking import local_store_uri

    started = time.monotonic()
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    preset, subs = rehearsal_preset(preset_name, backend)
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    workspace = output_dir / "pvc" / "lingo-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    subs.append(
        Substitution(
            "workspace volume",
            f"PVC lingo-workspace at {preset_mount(preset)}",
            str(workspace),
            "a directory shared by every local process, mounted where the pods mount it",
        )
    )
    spec, platform, arguments, configs = compile_rehearsal(
        preset, output_dir / "pipeline.yaml", workspace
    )
    tracking = local_store_uri(output_dir)
    arguments["mlflow_tracking_uri"] = ""
    secrets = rehearsal_secrets(tracking)
    subs.append(
        Substitution(
            "Secrets",
            "lingo-s3, lingo-mlflow, lingo-hf",
            f"MLflow → {tracking}; others empty",
            "no cluster Secrets here",
        )  # fmt: skip
    )
    trainer = run_plan(preset).trainer
    pythons, image_subs = _image_pythons(trainer.image, output_dir)
    subs += image_subs
    subs.append(
        Substitution(
            "CPU threads",
            "OMP_NUM_THREADS as each job pod's spec sets it (its CPU request over its ranks)",
            f"the same value, each process held to {POD_THREAD_LIMIT} thread (OMP_THREAD_LIMIT)",
            "a node's ranks sized for its CPUs (8 × 22 threads) wait on each other's threads "
            "at every parallel region on a few cores; the OMP check reads the spec's value",
        )
    )
    runner, pods, expanded, static = _run_on_local_cluster(
        preset, (spec, platform, arguments, configs), output_dir, pythons, secrets, job_api, subs
    )
    ran = {r.task for r in runner.records}
    not_run = sorted(
        label.removeprefix("exec-") for label in spec["deploymentSpec"]["executors"]
        if label.removeprefix("exec-") not in ran
    )  # fmt: skip
    checks = [
        omp_check(pods, static),
        primary_pod_check({**static, **expanded}),
        mismatch_gate_check(preset, workspace, ran),
    ]
    if trainer.needs_conversion:
        checks.insert(0, conversion_check(spec, platform, configs, output_dir / "kfp"))
    return RehearsalReport(
        preset.name, preset.backend, runner.records, not_run, pods, checks, subs, output_dir,
        time.monotonic() - started,
    )  # fmt: skip


def _image_pythons(
    trainer_image: str, output_dir: Path
) -> tuple[dict[str, str], list[Substitution]]:
    """Each image's Python environment on this machine (image → Python: ``image_pythons``,
    with the Megatron image's CPU stand-in when the branch trains in it: ``trainer_image``,
    ``plan.TrainerSpec.image``), and the substitutions that say so."""
    from components.images import MEGATRON_IMAGE, TRAINER_IMAGES

    pythons = image_pythons()
    subs = []
    if TRAINER_IMAGES[trainer_image] == MEGATRON_IMAGE:  # its TE layers and CUDA: a stand-in
        pythons[MEGATRON_IMAGE] = str(megatron_cpu_python(output_dir))
        subs.append(
            Substitution(
                "Transformer Engine",
                "the Megatron image's TE layers and CUDA",
                "megatron-core's local layer spec and the test-only CPU patches "
                "(tests/megatron/cpu_patches.py, test_megatron_grpo_step.py), every process",
                "TE and CUDA need a GPU; each patch says why it cannot change a number",
            )
        )
    return pythons, subs + [
        Substitution("image", image, python, "the image's Python environment on this machine")
        for image, python in pythons.items()
    ]


def _run_on_local_cluster(
    preset: Preset,
    compiled: tuple[dict, dict, dict, dict],
    output_dir: Path,
    pythons: dict[str, str],
    secrets: dict,
    job_api: str,
    subs: list[Substitution],
):
    """Run the compiled pipeline (``compile_rehearsal``'s spec, platform, arguments and
    configs) with kfp.local, each task as its pod, on a local cluster serving ``job_api``
    (its Kubernetes API substitution joins ``subs``). The pod runner, the pods the cluster
    ran, the jobs it expanded, and the pods each training step's job would make."""
    from google.protobuf import json_format
    from kfp import local
    from kfp.local import pipeline_orchestrator
    from kfp.pipeline_spec import pipeline_spec_pb2

    from cluster.local_cluster import LocalCluster
    from components.images import GPU_IMAGE

    spec, platform, arguments, configs = compiled
    controllers = {
        "trainjob": "Trainer v2.3.0 and JobSet controllers",
        "pytorchjob": "Training Operator v1.9.0 (PyTorchJob) controller",
    }[job_api]
    with LocalCluster(
        output_dir / "cluster", pythons, secrets, REPO_ROOT, "default", job_apis=(job_api,),
        thread_limit=POD_THREAD_LIMIT,
    ) as cluster:  # fmt: skip
        if job_spec(job_api, "--job-api").cluster_runtime_plural:
            cluster.install_runtime(rehearsal_runtime(configs, GPU_IMAGE))
        subs.append(
            Substitution(
                "Kubernetes API",
                f"the cluster's API server, {controllers}",
                f"kmock emulator + cluster.local_cluster (kubeconfig {cluster.kubeconfig})",
                "no API server runs here; pods are local process groups, gloo for NCCL",
            )  # fmt: skip
        )
        pod_env = {
            "KUBECONFIG": str(cluster.kubeconfig),
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", ""),
            "HF_HUB_OFFLINE": "1",
        }
        logs = output_dir / "logs"
        logs.mkdir(exist_ok=True)
        runner = _PodRunner(spec, platform, pod_env, secrets, logs, pythons)
        local.init(
            runner=local.SubprocessRunner(use_venv=False),
            pipeline_root=str(output_dir / "kfp"),
            raise_on_error=False,
        )
        pipeline_spec = json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
        with _pods_as_handler(runner):
            pipeline_orchestrator.run_local_pipeline(pipeline_spec, arguments)
        pods = list(cluster.pods)
        expanded = dict(cluster.expanded)
        static = static_job_pods(preset, configs, cluster, job_api)
    return runner, pods, expanded, static


def rehearsal_runtime(configs: dict, image: str) -> dict:
    """The ClusterTrainingRuntime ``lingo cluster install-runtime`` installs for the preset
    (``pipelines.presets.training_runtime``), the workspace at the rehearsal's mount."""
    from cluster.config import ExecutionConfig
    from cluster.trainjob import build_training_runtime

    execution = ExecutionConfig.model_validate(configs["sft_execution"])
    return build_training_runtime(execution.cluster_job(image, default_namespace="default"))


def preset_mount(preset: Preset) -> str:
    from pipelines.platform import get_platform

    return get_platform(preset.hardware.platform).workspace_mount


def static_job_pods(
    preset: Preset, configs: dict, cluster, job_api: str = "trainjob"
) -> dict[str, list]:
    """Each training step's job as its step would create it (``cluster.step_job``), expanded
    by the controller into pods without running them: the checks see the GRPO job even where
    an earlier step fails."""
    from cluster.config import ExecutionConfig
    from cluster.local_cluster import controller_pods
    from cluster.step_job import (
        StepJob,
        build_step_manifest,
        build_step_runtime,
        job_name,
        step_cluster,
    )
    from components.images import GPU_IMAGE, TRAINER_IMAGES
    from pipelines.presets import grpo_branch_config

    grpo = grpo_branch_config(preset)
    steps = {
        "sft": (preset.sft, GPU_IMAGE, None),
        "grpo": (grpo, TRAINER_IMAGES[grpo.optim.trainer.image], GPU_IMAGE),
    }
    pods = {}
    for step, (config, image, rollout_image) in steps.items():
        execution = ExecutionConfig.model_validate(configs[f"{step}_execution"])
        if execution.mode != "job":
            continue
        job_cluster = step_cluster(execution, image, "default", rollout_image)
        job = StepJob(step, f"trainer.{step}", config, "model", "m", "t", "e")
        args = ["--config", f"{job_cluster.shared_mount}/{step}_config.json"]
        kind = job_spec(job_api, "--job-api")
        label = f"{job_name(step, 'static')} (as built)"
        try:
            manifest = build_step_manifest(job, job_cluster, "static", args, kind)
        except ValueError as error:  # the step fails the same way; its report says why
            log.warning("%s: %s", label, error)
            continue
        runtime = build_step_runtime(job, job_cluster, "static", args, kind)
        if runtime is None and kind.cluster_runtime_plural:
            runtime = rehearsal_runtime(configs, image)
        pods[label] = controller_pods(manifest, runtime)
    return pods


def omp_check(pods: list, static: dict[str, list]) -> Check:
    """Each rank's ``OMP_NUM_THREADS`` (the pod's env, else what torchrun sets) against the
    node's CPUs: 1 thread on a node of more CPUs than processes idles the rest."""
    from cluster.local_cluster import cpu_cores, torchrun_omp_threads

    built, ran, seen = [], [], []
    for name, expanded in static.items():
        for pod in expanded:
            env = {e["name"]: str(e.get("value", "")) for e in pod.container.get("env") or []}
            nproc = int(env.get("PET_NPROC_PER_NODE") or _flag(pod.container["command"]) or 1)
            cpu = cpu_cores(
                ((pod.container.get("resources") or {}).get("requests") or {}).get("cpu")
            )
            threads = torchrun_omp_threads(env, nproc)
            seen.append(
                f"{pod.name}: {nproc} ranks, {cpu} CPUs, OMP_NUM_THREADS={threads or 'unset'}"
            )
            if threads == "1" and cpu is not None and cpu > nproc:
                built.append(f"{pod.name} ({name}): {nproc} ranks × 1 thread on {cpu:g} CPUs")
    for pod in pods:
        observed = sorted(set(pod.rank_env.values()))
        if observed:
            seen.append(f"{pod.name} ran: {len(pod.rank_env)} ranks, OMP_NUM_THREADS {observed}")
            if observed == ["1"] and pod.cpu is not None and pod.cpu > pod.nproc_per_node:
                ran.append(
                    f"{pod.name} (ran): its {len(pod.rank_env)} ranks had OMP_NUM_THREADS=1 "
                    f"on {pod.cpu:g} CPUs"
                )
    if built or ran:
        shown = built[:2] + ran[:2]
        more = len(built) + len(ran) - len(shown)
        detail = "; ".join(shown) + (f" (+{more} more pods)" if more else "")
        return Check("OMP_NUM_THREADS per rank", False, detail)
    return Check("OMP_NUM_THREADS per rank", True, "; ".join(seen[:3]))


def _flag(command: list[str]) -> str | None:
    return command[command.index("--nproc-per-node") + 1] if "--nproc-per-node" in command else None


def primary_pod_check(jobs: dict[str, list]) -> Check:
    """OpenShift AI's primary-pod rule (``cluster.local_cluster.PRIMARY_POD_RULE``) on each
    job's pods: the pod it picks must be the trainer's ``node-0-0`` (a PyTorchJob's
    ``master-0``: global rank 0). Where several match (the two-image job's ``rollout-0-0``
    carries the same labels, issue #39 defect 6), the controller takes the first the API lists,
    by name: passes only when every other match's replicated job sorts after the trainers'
    (``cluster.trainjob.sorts_after_trainers``, the rule docs/cluster.md quotes)."""
    from cluster.local_cluster import primary_pod_matches
    from cluster.trainjob import sorts_after_trainers

    problems, fine = [], []
    for name, pods in jobs.items():
        matches = primary_pod_matches(pods)
        trainer = [p.name for p in pods if p.name.endswith(("-node-0-0", "-master-0"))]
        others = [p.replicated_job for p in pods if p.name in matches[1:]]
        if matches[:1] != trainer or not all(sorts_after_trainers(o) for o in others):
            problems.append(f"{name}: {len(matches)} pods match ({', '.join(matches)})")
        elif others:
            fine.append(
                f"{name}: {len(matches)} pods match, the trainer's {matches[0]} sorts first "
                "(sorts_after_trainers)"
            )
        else:
            fine.append(f"{name}: {matches[0]}")
    if problems:
        return Check("primary pod (job-index 0, completion-index 0)", False, "; ".join(problems))
    return Check("primary pod (job-index 0, completion-index 0)", True, "; ".join(fine))


def conversion_check(
    spec: dict, platform: dict, configs: dict, outputs: Path | None = None
) -> Check:
    """The ``convert-megatron`` pod against the layout it converts at: megatron-core's
    model-parallel groups need a world of at least TP × PP × CP processes, with EP × ETP
    dividing it; a pod of one process (the KFP executor, no torchrun, no ``WORLD_SIZE``)
    builds a one-rank group. The layout is the one the step writes
    (``trainer.megatron.layout.conversion_layout``, the component's own choice), and, when the
    step ran, the one its checkpoint's manifest records (issue #39 item 1: the step had been
    handed the GRPO layout, TP 8 / EP 8)."""
    from trainer.megatron.layout import conversion_layout, resolve_megatron_layout
    from trainer.megatron.manifest import MANIFEST_FILE

    name = "convert-megatron processes = layout world size"
    training = resolve_megatron_layout(configs["megatron_layout"])
    layout = conversion_layout(training)
    written = sorted(outputs.rglob(MANIFEST_FILE)) if outputs else []
    if written:  # the step ran: the layout its checkpoint was written at
        layout = resolve_megatron_layout(json.loads(written[-1].read_text())["layout"])
    world = max(layout.tp * layout.pp * layout.cp, layout.ep * layout.etp)
    container = spec["deploymentSpec"]["executors"]["exec-convert-megatron"]["container"]
    command = " ".join([*container.get("command", []), *container.get("args", [])])
    env = {e["name"] for e in container.get("env") or []}
    launcher = "torch.distributed.run" in command or "torchrun" in command
    processes = "torchrun" if launcher else ("WORLD_SIZE" in env and "env") or 1
    sizes = f"TP {layout.tp}, PP {layout.pp}, EP {layout.ep}"
    source = "its manifest" if written else "conversion_layout"
    if processes == 1 and world > 1:
        return Check(
            name, False,
            f"layout {layout.name} ({sizes}, from {source}) needs world size {world}; the step "
            "runs as one KFP pod of one process (no torchrun, no WORLD_SIZE)",
        )  # fmt: skip
    return Check(
        name, True,
        f"converts at {sizes} (from {source}; trains at TP {training.tp}, EP {training.ep}, "
        f"resharded on load), world size {world}: {processes}",
    )  # fmt: skip


def mismatch_gate_check(preset: Preset, workspace: Path, ran: set[str]) -> Check:
    """Whether the GRPO mismatch gate bounded any step. The gate learns one floor per
    staleness from the first step at that staleness (``trainer.grpo.mismatch.MismatchGate``:
    ``staleness`` on the step's metrics line) and bounds the later ones; before issue #39 it
    looked at on-policy steps only, so a run one step off-policy (every step after the first
    stale) was never gated."""
    name = "GRPO mismatch gate bounded a step"
    if preset.grpo.rollout.max_mismatch_kl is None:
        return Check(name, None, "rollout.max_mismatch_kl is None: no gate")
    files = sorted(workspace.glob("lingo-rl-jobs/lingo-grpo-*/work/training_metrics.jsonl"))
    if not files:
        return Check(name, None, "GRPO wrote no training_metrics.jsonl (it did not train)")
    lines = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    measured = [r for r in lines if "rollout_kl" in r]
    if len(measured) < 2:
        return Check(name, None, f"GRPO logged {len(measured)} step(s) that measured rollout_kl")
    by_staleness: dict[int, list[int]] = {}
    for r in measured:
        by_staleness.setdefault(int(r.get("staleness", 0)), []).append(r["step"])
    floors = ", ".join(
        f"step {steps[0]} (staleness {k})" for k, steps in sorted(by_staleness.items())
    )
    bounded = sorted(step for steps in by_staleness.values() for step in steps[1:])
    if not bounded:
        return Check(
            name, False,
            f"{len(measured)} steps measured rollout_kl, each the first of its staleness "
            f"(the floors: {floors}): no step was bounded",
        )  # fmt: skip
    return Check(name, True, f"steps {bounded} bounded (the floors: {floors})")
