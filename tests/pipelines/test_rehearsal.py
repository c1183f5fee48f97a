"""``lingo rehearse`` (issue #39): the 20b presets' compiled pipelines run whole on CPU, each
task as its pod, each TrainJob expanded into pods run as local process groups.

On main as of d393f04 the rehearsal failed at defects the issue lists (the OMP threads of every
rank, the mismatch gate that never evaluates, the conversion's world size, the primary pod of
a two-image job: docs/rehearsal.md shows what it printed); with those fixed, the DeepSpeed
rehearsals of both 20b presets pass. The Megatron one is a strict xfail until its image's env
can run the pipeline's steps (a fix turns it into a failure that asks for the marker to go)."""

from __future__ import annotations

import pytest
from compiled_form import configure_run
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.presets import PRESETS
from pipelines.rehearsal import (
    compile_rehearsal,
    rehearsal_preset,
    rehearsal_secrets,
    rehearse,
    substitutions,
)


@pytest.fixture(scope="module")
def deepspeed_report(tmp_path_factory):
    return rehearse("gpt-oss-20b", tmp_path_factory.mktemp("rehearsal"))


def test_the_rehearsal_keeps_the_machines_and_lists_what_it_substitutes():
    """The preset's nodes and processes stay; the model keeps the parallel sizes dividing."""
    for name in ("gpt-oss-20b", "gpt-oss-20b-verl"):
        preset, subs = rehearsal_preset(name)
        original = PRESETS[name]
        assert preset.hardware == original.hardware
        assert (preset.sft.nproc, preset.grpo.nproc) == (original.sft.nproc, original.grpo.nproc)
        assert preset.grpo.rollout_processes == original.grpo.rollout_processes
        tiny = preset.model.tiny
        for size in (8,):  # the verl layout's TP 8 and EP 8
            assert tiny.num_attention_heads % size == 0
            assert tiny.num_key_value_heads % size == 0
            assert tiny.num_local_experts % size == 0
        assert {s.what for s in subs} >= {"model", "data", "rollout engine", "dtype"}
        # CI time (issue #39): each GRPO step still runs the preset's samples a prompt, more
        # than one optimizer step and gradient accumulation over 2 micro-batches a rank;
        # every training rank gets a prompt, and SFT's final evaluation one example a rank
        grpo = preset.grpo
        rollouts = grpo.prompts_per_step * grpo.rollout.n_samples
        assert grpo.rollout.n_samples == original.grpo.rollout.n_samples
        assert rollouts // grpo.mini_batch_size >= 2
        assert grpo.mini_batch_size // (grpo.micro_batch_size * grpo.nproc) == 2
        assert grpo.prompts_per_step == grpo.nproc
        assert preset.sft.eval_max_examples == preset.sft.nproc
    overrides, _ = substitutions(PRESETS["tiny-cpu"])
    assert "grpo.rollout.engine" not in overrides  # only a vLLM engine is substituted


def test_the_megatron_branch_trains_at_the_closest_layout_a_cpu_runs():
    """verl's TP 8 / EP 8 / sequence-parallel bf16 layout becomes TP 1 / EP 1 fp32 over the
    same 8 training processes (data-parallel), and the report says so."""
    from trainer.megatron.layout import resolve_megatron_layout

    preset, subs = rehearsal_preset("gpt-oss-20b-verl", "megatron")
    layout = resolve_megatron_layout(preset.megatron_layout)
    assert (layout.tp, layout.pp, layout.ep, layout.sequence_parallel) == (1, 1, 1, False)
    assert layout.name == "verl-gpt-oss-8x8-h100" and preset.grpo.nproc == 8
    (sub,) = [s for s in subs if s.what == "Megatron layout"]
    assert "tp 8, ep 8" in sub.preset and "Transformer Engine" in sub.why
    _, hf_subs = rehearsal_preset("gpt-oss-20b-verl", "hf")
    assert "Megatron layout" not in {s.what for s in hf_subs}


def test_a_local_preset_or_an_unknown_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rehearse a cluster preset"):
        rehearsal_preset("tiny-cpu")
    for args, hint in (
        (["--preset", "tiny-cpu"], "--preset"),
        (["--backend", "deepspeed"], "--backend"),
        (["--job-api", "mpijob"], "--job-api"),
    ):
        result = CliRunner().invoke(app, ["rehearse", *args, "-o", str(tmp_path)])
        assert result.exit_code == 2 and hint in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # nothing ran


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_deepspeed_branch_runs_as_its_pods(deepspeed_report):
    """gpt-oss-20b on DeepSpeed: every task of its branch ran as its pod and ended 0; SFT ran
    as 2 pods of 4 ranks and GRPO as 6 (4 training, 2 rollout-only), each rank seen with its
    env; the one-image job has one primary pod; the table names every substitution."""
    report = deepspeed_report
    table = report.table()
    assert [t.task for t in report.tasks if t.returncode != 0] == [], table
    ran = {t.task for t in report.tasks}
    assert {"data-prep", "base-model", "sft", "grpo", "export-hf", "evaluate", "gate"} <= ran
    assert "convert-megatron" not in ran, table  # gpt-oss-20b compiles its hf branch only
    jobs: dict[str, list] = {}
    for pod in report.pods:
        jobs.setdefault(pod.job.split("-")[1], []).append(pod)
    assert {step: len(pods) for step, pods in jobs.items()} == {"sft": 2, "grpo": 6}, table
    assert all(p.returncode == 0 and p.nproc_per_node == 4 for p in report.pods), table
    assert all(p.rank_env for p in report.pods), "each pod's ranks were seen"
    for sub in report.substitutions:
        assert sub.line() in table
    checks = {c.name: c for c in report.checks}
    assert checks["primary pod (job-index 0, completion-index 0)"].passed, table
    assert all(c.passed is not None for c in report.checks), table


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_deepspeed_rehearsal_passes(deepspeed_report):
    assert deepspeed_report.passed, deepspeed_report.table()


@pytest.fixture(scope="module")
def megatron_report(tmp_path_factory):
    return rehearse("gpt-oss-20b-verl", tmp_path_factory.mktemp("rehearsal-megatron"), "megatron")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_megatron_branch_reaches_the_conversion(megatron_report):
    """gpt-oss-20b-verl on Megatron: everything before the conversion runs as its pod (SFT as
    1 pod of 8 ranks); the conversion runs as its pod; the checks see the conversion's pod
    and the GRPO job's pods as its step builds them."""
    report = megatron_report
    table = report.table()
    results = {t.task: t.returncode for t in report.tasks}
    before = ("data-prep", "base-model", "capacity-check", "sft")
    assert all(results[task] == 0 for task in before), table
    assert "convert-megatron" in results, table
    sft = [p for p in report.pods if p.job.startswith("lingo-sft-")]
    assert [p.name.rsplit("-", 3)[1:] for p in sft] == [["node", "0", "0"]], table
    assert sft[0].nproc_per_node == 8
    # the Megatron image's steps ran in the Megatron env with the CPU patches (its image is a
    # run parameter the rehearsal resolves), not in the project's venv
    (convert,) = [t for t in report.tasks if t.task == "convert-megatron"]
    assert convert.python.endswith(".venv-megatron-cpu/bin/python"), table
    checks = {c.name: c for c in report.checks}
    assert checks["convert-megatron processes = layout world size"].passed is not None
    assert checks["primary pod (job-index 0, completion-index 0)"].passed is not None


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.xfail(
    strict=True,
    reason="not yet seen passing whole: the Megatron image's steps run in .venv-megatron with "
    "the CPU patches at TP 1 / EP 1, and SFT and convert-megatron pass (precision check max "
    "|Δ logit| 3e-07); the grpo-2 step's pod then failed at `import cluster.pytorchjob`: the "
    "env lacked the cluster extra (kubeflow-training), which the Megatron image installs "
    "(.[megatron,cluster]); tools/megatron_env.sh --with-project now installs it, the "
    "rehearsal checks for it, and the Megatron GRPO job has not been rerun since",
)
def test_the_megatron_rehearsal_passes(megatron_report):
    assert megatron_report.passed, megatron_report.table()


def test_a_tasks_image_given_as_a_run_parameter_is_the_value_it_got(tmp_path):
    """The images are run parameters, so the compiled IR's convert-megatron executor names a
    placeholder; its pod runs the image the task got (else the Megatron image's steps would
    run in the project's venv, as they did before: 'No module named megatron')."""
    import json

    from components.images import MEGATRON_IMAGE
    from pipelines.rehearsal import resolve_image

    preset, _ = rehearsal_preset("gpt-oss-20b-verl", "megatron")
    spec, *_ = compile_rehearsal(preset, tmp_path / "p.yaml", tmp_path)
    image = spec["deploymentSpec"]["executors"]["exec-convert-megatron"]["container"]["image"]
    assert image.startswith("{{$.inputs.parameters[")
    name = image.split("'")[1]
    given = {"inputs": {"parameterValues": {name: MEGATRON_IMAGE}}}
    assert resolve_image(image, ["--executor_input", json.dumps(given)]) == MEGATRON_IMAGE
    with pytest.raises(RuntimeError, match="names no parameter"):
        resolve_image(image, ["--executor_input", json.dumps({"inputs": {}})])
    assert resolve_image(MEGATRON_IMAGE, []) == MEGATRON_IMAGE


def test_the_compiled_pods_get_every_secret_key_and_the_local_volume(tmp_path):
    """The preset compiled as the rehearsal compiles it: every Secret key a task's
    ``secretAsEnv`` names has a value, every ``pvcMount`` is the local workspace, and the
    training steps' jobs mount it too (their ``shared_mount`` argument)."""
    preset, _ = rehearsal_preset("gpt-oss-20b")
    spec, platform, arguments, configs = compile_rehearsal(preset, tmp_path / "p.yaml", tmp_path)
    secrets = rehearsal_secrets("sqlite:///x.db")
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) <= set(spec["deploymentSpec"]["executors"])
    for label, executor in executors.items():
        for secret in executor.get("secretAsEnv", []):
            keys = {pair["secretKey"] for pair in secret["keyToEnv"]}
            assert keys <= set(secrets[secret["secretName"]]), label
        assert [m["mountPath"] for m in executor.get("pvcMount", [])] == [str(tmp_path)], label
    for step in ("sft_execution", "grpo_execution"):
        assert configs[step]["job"]["shared_mount"] == str(tmp_path)
    # the jobs get the mount from the configure step, as compiled: the run's own configs
    run = configure_run(tmp_path / "p.yaml")
    for step in ("sft_execution", "grpo_execution"):
        assert run[step]["job"]["shared_mount"] == str(tmp_path)
    assert secrets["lingo-mlflow"]["MLFLOW_TRACKING_URI"] == "sqlite:///x.db"


@pytest.fixture(scope="module")
def verl_report(tmp_path_factory):
    return rehearse("gpt-oss-20b-verl", tmp_path_factory.mktemp("rehearsal-verl"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_verl_preset_runs_whole_on_deepspeed(verl_report):
    """gpt-oss-20b-verl on DeepSpeed: every task of its branch ran as its pod and ended 0
    (SFT 1 pod × 8 ranks; GRPO 2 pods × 8: the training node and the engines' node)."""
    report = verl_report
    table = report.table()
    assert [t.task for t in report.tasks if t.returncode != 0] == [], table
    ran = {t.task for t in report.tasks}
    assert {"sft", "grpo", "export-hf", "evaluate", "gate", "finalize"} <= ran, table
    assert sorted(p.name.split("-", 3)[1] for p in report.pods) == ["grpo", "grpo", "sft"]
    assert all(p.returncode == 0 and p.nproc_per_node == 8 for p in report.pods), table
    checks = {c.name: c for c in report.checks}
    assert checks["GRPO mismatch gate bounded a step"].passed is not None, table


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_verl_rehearsal_passes(verl_report):
    assert verl_report.passed, verl_report.table()


def test_a_pytorchjob_cluster_runs_the_verl_jobs_as_master_and_workers(tmp_path):
    """``--job-api pytorchjob``: the verl preset's jobs as its steps build them for a cluster
    serving only PyTorchJob: SFT one Master of 8 ranks, GRPO the training Master (the GPU
    image) and one rollout Worker, rank 0 the Master's; gpt-oss-20b's one-image jobs a
    Master and Workers (SFT 2 nodes, GRPO 4 training + 2 rollout-only nodes); in each the
    primary-pod rule picks the Master."""
    import json

    from pipelines.platform import get_platform
    from pipelines.presets import job_platform_json, step_configs
    from pipelines.rehearsal import primary_pod_check, static_job_pods

    for name, expected in (
        ("gpt-oss-20b-verl", {"sft": ["master-0"], "grpo": ["master-0", "worker-0"]}),
        (
            "gpt-oss-20b",
            {
                "sft": ["master-0", "worker-0"],
                "grpo": ["master-0"] + [f"worker-{i}" for i in range(5)],
            },
        ),
    ):
        preset, _ = rehearsal_preset(name)
        settings = get_platform(preset.hardware.platform)
        configs = step_configs(preset, json.loads(job_platform_json(settings)))
        jobs = static_job_pods(preset, configs, None, "pytorchjob")
        names = {
            label.split("-")[1]: [p.name.split("-static-")[1] for p in pods]
            for label, pods in jobs.items()
        }
        assert names == expected, (name, names)
        for pods in jobs.values():
            env = {e["name"]: e.get("value") for e in pods[0].container["env"]}
            assert env["RANK"] == "0"
            assert env["WORLD_SIZE"] == str(len(pods) * int(env["PET_NPROC_PER_NODE"]))
        assert primary_pod_check(jobs).passed, name


def test_the_megatron_image_needs_the_megatron_env_with_the_project(tmp_path, monkeypatch):
    """Without megatron-core (here: the project's own venv as the Megatron env) the rehearsal
    refuses to start, naming the command that builds the env."""
    import sys
    from pathlib import Path

    from pipelines import rehearsal

    monkeypatch.setattr(rehearsal, "MEGATRON_PYTHON", Path(sys.executable))
    with pytest.raises(RuntimeError, match="megatron_env.sh --with-project"):
        rehearsal.megatron_cpu_python(tmp_path)
    monkeypatch.setattr(rehearsal, "MEGATRON_PYTHON", tmp_path / "missing" / "python")
    with pytest.raises(RuntimeError, match="megatron_env.sh --with-project"):
        rehearsal.megatron_cpu_python(tmp_path)


def test_the_megatron_image_runs_in_the_projects_venv_when_the_megatron_env_lacks_it(
    tmp_path, monkeypatch
):
    """`make test-megatron` builds .venv-megatron without the project (no kfp): the DeepSpeed
    branch's export-hf, which runs in the Megatron image, then runs in the project's venv
    (reproduces CI: 'No module named kfp' from .venv-megatron's python, the verl rehearsal
    failed at export-hf); an env holding the project is used as the image."""
    import sys

    from components.images import MEGATRON_IMAGE
    from pipelines import rehearsal

    bare = tmp_path / "bare" / "bin" / "python"
    bare.parent.mkdir(parents=True)
    bare.write_text("#!/bin/sh\nexit 1\n")  # every import fails, as kfp does there
    bare.chmod(0o755)
    monkeypatch.setattr(rehearsal, "MEGATRON_PYTHON", bare)
    assert rehearsal.image_pythons()[MEGATRON_IMAGE] == sys.executable
    full = tmp_path / "full" / "bin" / "python"
    full.parent.mkdir(parents=True)
    full.write_text("#!/bin/sh\nexit 0\n")  # every import succeeds
    full.chmod(0o755)
    monkeypatch.setattr(rehearsal, "MEGATRON_PYTHON", full)
    assert rehearsal.image_pythons()[MEGATRON_IMAGE] == str(full)
