"""The cluster: ``lingo rehearse`` and ``lingo cluster`` (``install-runtime``, ``setup``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.cli.app import SetOption, app, clear_errors, echo, load_preset


@app.command()
@clear_errors
def rehearse(
    preset: Annotated[
        str, typer.Option(help="A cluster preset: gpt-oss-20b or gpt-oss-20b-verl.")
    ] = "gpt-oss-20b",
    backend: Annotated[
        str | None, typer.Option(help="The GRPO branch: hf or megatron (default: the preset's).")
    ] = None,
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "-o", help="Where the rehearsal's run goes.")
    ] = Path("runs/rehearsal"),
    job_api: Annotated[
        str,
        typer.Option(
            help="The job API the rehearsal's cluster serves: trainjob (Trainer v2) or "
            "pytorchjob (Training Operator v1); the preset's job_api: auto picks it."
        ),
    ] = "trainjob",
) -> None:
    """Run a cluster preset's compiled pipeline on this machine as a cluster runs it: each
    step as its pod, each TrainJob (or PyTorchJob) expanded into pods (local processes), a
    scaled-down model; print what ran, what was substituted and the result; exit 1 when
    anything failed."""
    from pipelines.rehearsal import rehearse as run_rehearsal
    from plan import GRPO_BRANCHES, UnknownSpecError, job_spec

    if backend not in (None, *GRPO_BRANCHES):
        raise typer.BadParameter(
            f"{backend!r}: use {' or '.join(GRPO_BRANCHES)}", param_hint="--backend"
        )
    try:
        job_spec(job_api, "--job-api")
    except UnknownSpecError as error:
        raise typer.BadParameter(str(error), param_hint="--job-api") from None
    if load_preset(preset, None).hardware.local:
        raise typer.BadParameter(
            f"{preset!r} runs on this machine already (lingo run --local); rehearse a cluster "
            "preset: gpt-oss-20b, gpt-oss-20b-verl",
            param_hint="--preset",
        )
    report = run_rehearsal(preset, output_dir, backend, job_api)
    echo(report.table())
    if not report.passed:
        raise typer.Exit(1)


cluster_app = typer.Typer(help="Set up a Kubernetes cluster for lingo-rl's training jobs.")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("install-runtime")
@clear_errors
def install_runtime(
    preset: Annotated[
        str, typer.Option(help="The cluster preset whose volume and runtime name to use.")
    ] = "gpt-oss-20b",
    image: Annotated[
        str | None,
        typer.Option(help="The training image [default: the GPU image, LINGO_GPU_IMAGE]."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the YAML (for kubectl apply -f) instead.")
    ] = False,
    sets: SetOption = None,
) -> None:
    """Install (or update) the ClusterTrainingRuntime the TrainJobs reference (Kubeflow
    Trainer v2): torchrun on the training image, the shared PVC, /dev/shm. Needs rights on
    cluster-scoped clustertrainingruntimes (a cluster admin's)."""
    from components.images import GPU_IMAGE
    from pipelines.presets import training_runtime

    config = load_preset(preset, sets)
    try:
        runtime = training_runtime(config, image or GPU_IMAGE)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    if dry_run:
        from cluster.pytorchjob import manifest_yaml

        typer.echo(RUNTIME_HEADER + manifest_yaml(runtime), nl=False)
        return
    from cluster.launcher import install_training_runtime

    done = install_training_runtime(runtime)
    echo(f"{done} ClusterTrainingRuntime {runtime['metadata']['name']}")


RUNTIME_HEADER = (
    "# The ClusterTrainingRuntime lingo-rl's TrainJobs reference (Kubeflow Trainer v2.3).\n"
    "# Install: kubectl apply -f deploy/cluster-training-runtime.yaml, or\n"
    "# lingo cluster install-runtime. Written by: lingo cluster install-runtime --dry-run\n"
)


@cluster_app.command("setup")
@clear_errors
def setup(
    namespace: Annotated[
        str | None,
        typer.Option(help="Where the pipeline runs [default: the kubeconfig context's]."),
    ] = None,
    service_account: Annotated[
        str,
        typer.Option(
            help="The pipeline's service account: Data Science Pipelines' "
            "pipeline-runner-<DSPA name>."
        ),
    ] = "pipeline-runner-dspa",
    preset: Annotated[
        str, typer.Option(help="The cluster preset whose platform (volume, Secrets) to set up.")
    ] = "gpt-oss-20b",
    image: Annotated[
        str | None,
        typer.Option(help="The runtime's training image [default: the GPU image]."),
    ] = None,
    workspace_size: Annotated[
        str, typer.Option(help="The workspace PVC's size, when it is created.")
    ] = "500Gi",
    storage_class: Annotated[
        str | None,
        typer.Option(help="The workspace PVC's storage class (ReadWriteMany) [default: none]."),
    ] = None,
    skip_runtime: Annotated[
        bool,
        typer.Option(
            "--skip-runtime",
            help="Leave the ClusterTrainingRuntime out (a cluster admin installs it).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the manifests (Secrets as comments) instead."),
    ] = False,
    sets: SetOption = None,
) -> None:
    """Set a namespace up for the pipeline's training jobs, in one command: the
    ClusterTrainingRuntime, a Role and RoleBinding for the pipeline's service account
    (TrainJobs, TrainingRuntimes, PyTorchJobs; JobSets, pods, logs, events read), the
    workspace PVC if missing, and a Secret for each of the platform's Secrets whose
    variables are set here (S3, MLflow, Hugging Face: all optional)."""
    import os

    from cluster.setup import SecretSource, setup_plan
    from components.images import GPU_IMAGE
    from pipelines.platform import get_platform
    from pipelines.presets import training_runtime

    config = load_preset(preset, sets)
    platform = get_platform(config.hardware.platform)
    try:
        runtime = None if skip_runtime else training_runtime(config, image or GPU_IMAGE)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    api_client = None
    if not dry_run:
        from cluster.launcher import default_api_client

        api_client = default_api_client()
    namespace = namespace or _context_namespace(fallback="default" if dry_run else None)
    workspace = (
        (platform.workspace_pvc, workspace_size, storage_class) if platform.workspace_pvc else None
    )
    sources = [SecretSource(s.secret_name, s.key_to_env, s.steps) for s in platform.secrets]
    plan = setup_plan(namespace, service_account, runtime, workspace, sources, os.environ)
    if dry_run:
        _print_setup(plan)
        return
    from cluster.setup import apply_plan

    done, failed = apply_plan(plan, api_client)
    for line in done + plan.skipped:
        echo(line)
    for line in failed:
        echo(f"error: {line}", err=True)
    if failed:
        raise typer.Exit(1)


def _print_setup(plan) -> None:
    """``lingo setup --dry-run``: the plan's manifests as YAML documents, its Secrets as
    comments that name their keys (never their values), and what it would skip."""
    from cluster.pytorchjob import manifest_yaml
    from cluster.setup import describe_secret

    documents = [manifest_yaml(m) for m in plan.manifests() if m["kind"] != "Secret"]
    comments = [describe_secret(m) for m in plan.namespaced if m["kind"] == "Secret"]
    comments += [f"# {line}" for line in plan.skipped]
    typer.echo(SETUP_HEADER + "---\n".join(documents), nl=False)
    for line in comments:
        echo(line)


def _context_namespace(fallback: str | None = None) -> str:
    """The kubeconfig's current context's namespace (``default`` when it names none), else
    in a pod its own, else ``fallback``.

    Raises:
        typer.BadParameter: none of them (no ``fallback``).
    """
    from kubernetes import config as k8s_config

    from cluster.step_job import SERVICE_ACCOUNT_NAMESPACE

    try:
        _, context = k8s_config.list_kube_config_contexts()
    except (k8s_config.ConfigException, OSError) as exc:
        if SERVICE_ACCOUNT_NAMESPACE.exists():
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        if fallback is not None:
            return fallback
        raise typer.BadParameter(
            f"none given, and no kubeconfig context to take it from ({exc})",
            param_hint="--namespace",
        ) from exc
    return context["context"].get("namespace", "default")


SETUP_HEADER = (
    "# What `lingo cluster setup` creates (kubectl apply -f; the ClusterTrainingRuntime takes a\n"
    "# cluster admin). Written by: lingo cluster setup --dry-run\n"
)
