"""The pipeline on a KFP endpoint: ``lingo submit``, ``schedule`` (its commands) and ``status``."""

from __future__ import annotations

from typing import Annotated

import typer

from pipelines.cli.app import PresetOption, SetOption, app, clear_errors, echo, load_preset
from pipelines.presets import (
    DEFAULT_PRESET,
)

EndpointOption = Annotated[
    str,
    typer.Option(
        "--endpoint",
        envvar="KFP_ENDPOINT",
        help="KFP API base URL (bearer token, if needed, from $KFP_TOKEN).",
    ),
]


@app.command()
@clear_errors
def submit(
    endpoint: EndpointOption,
    experiment: Annotated[
        str, typer.Option(help="KFP experiment, created if missing.")
    ] = "lingo-rl",
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the run until it ends.")] = False,
) -> None:
    """Compile the pipeline, upload it as a new version and start a run on a KFP server."""
    from pipelines.kfp_client import (
        KfpApiError,
        KfpConnection,
        RunFailedError,
        submit_preset,
        wait_for_run,
    )

    conn = KfpConnection.from_env(endpoint)
    try:
        submitted = submit_preset(conn, load_preset(preset, sets), experiment=experiment)
        echo(f"run {submitted.run_id}: {submitted.url}")
        if wait:
            echo(f"run {submitted.run_id}: {wait_for_run(conn, submitted.run_id).state}")
    except (KfpApiError, RunFailedError) as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc


schedule_app = typer.Typer(
    help="Schedule the pipeline (a recurring run pinned to the version uploaded now), or list, "
    "pause, resume and delete schedules.",
    no_args_is_help=False,
)
app.add_typer(schedule_app, name="schedule")
ExperimentOption = Annotated[str, typer.Option(help="KFP experiment, created if missing.")]
OptionalEndpoint = Annotated[
    str | None,
    typer.Option(
        "--endpoint",
        envvar="KFP_ENDPOINT",
        help="KFP API base URL (bearer token, if needed, from $KFP_TOKEN).",
    ),
]


@schedule_app.callback(invoke_without_command=True)
@clear_errors
def schedule(
    ctx: typer.Context,
    endpoint: OptionalEndpoint = None,
    cron: Annotated[
        str | None, typer.Option(help='Cron, 5 fields ("30 2 * * *") or KFP\'s 6.')
    ] = None,
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
    experiment: ExperimentOption = "lingo-rl",
    name: Annotated[
        str | None,
        typer.Option(
            help="The schedule's name [default: <preset>-recurring]; an existing "
            "schedule of that name in the experiment is replaced."
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be created and replaced; change nothing."),
    ] = False,
) -> None:
    """Upload the preset's pipeline as a new version and schedule it on --cron, pinned to that
    version (another preset's submit does not change what it runs); the same name again
    replaces the schedule."""
    if ctx.invoked_subcommand is not None:
        return
    if endpoint is None:
        raise typer.BadParameter(
            "give the KFP API URL (or set $KFP_ENDPOINT)", param_hint="--endpoint"
        )
    if cron is None:
        raise typer.BadParameter('give the schedule, e.g. --cron "30 2 * * *"', param_hint="--cron")
    from pipelines.kfp_client import CronError, KfpApiError, KfpConnection, cron_with_seconds
    from pipelines.schedules import plan_schedule, schedule_preset

    try:
        cron_with_seconds(cron)  # a bad cron fails before any request
    except CronError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cron") from exc
    conn = KfpConnection.from_env(endpoint)  # a bad endpoint: one line naming it
    config = load_preset(preset, sets)
    try:
        plan = plan_schedule(conn, config, cron, name=name, experiment=experiment)
        if dry_run:
            echo(f"dry run, nothing created:\n{plan.render()}")
            return
        created, version = schedule_preset(conn, config, plan)
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    echo(plan.render(version))
    echo(f"recurring run {created.recurring_run_id} {created.status} on {plan.cron!r}")


def _schedule_connection(endpoint: str | None):
    from pipelines.kfp_client import KfpConnection

    if endpoint is None:
        raise typer.BadParameter(
            "give the KFP API URL (or set $KFP_ENDPOINT)", param_hint="--endpoint"
        )
    return KfpConnection.from_env(endpoint)


@schedule_app.command("list")
@clear_errors
def schedule_list(
    endpoint: OptionalEndpoint = None,
    experiment: Annotated[
        str | None, typer.Option(help="Only this KFP experiment's schedules [default: all].")
    ] = None,
) -> None:
    """List the schedules: name, id, status, cron, pipeline version (pinned or latest)."""
    from pipelines.kfp_client import KfpApiError
    from pipelines.schedules import find_experiment, list_schedules

    conn = _schedule_connection(endpoint)
    try:
        experiment_id = find_experiment(conn, experiment) if experiment else None
        if experiment and experiment_id is None:
            echo(f"no experiment {experiment!r}: no schedules")
            return
        schedules = list_schedules(conn, experiment_id)
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    if not schedules:
        echo("no schedules")
    for s in schedules:
        version = s.pipeline_version_id or "latest (not pinned)"
        echo(
            f"{s.display_name}  {s.recurring_run_id}  {s.status}  {s.cron!r}  "
            f"pipeline {s.pipeline_id} version {version}"
        )


def _schedule_action(name: str, endpoint: str | None, experiment: str, action: str) -> None:
    """pause, resume or delete every schedule called ``name`` (or the one with that id)."""
    from pipelines.kfp_client import KfpApiError
    from pipelines.schedules import (
        ScheduleNotFoundError,
        delete_schedule,
        resolve_schedules,
        set_enabled,
    )

    conn = _schedule_connection(endpoint)
    try:
        for found in resolve_schedules(conn, name, experiment):
            if action == "delete":
                delete_schedule(conn, found)
            else:
                set_enabled(conn, found, action == "resume")
            done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[action]
            echo(f"{done} {found.display_name} ({found.recurring_run_id})")
    except ScheduleNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="NAME") from exc
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc


ScheduleName = Annotated[str, typer.Argument(help="The schedule's name (or its recurring run id).")]


@schedule_app.command("pause")
@clear_errors
def schedule_pause(
    name: ScheduleName,
    endpoint: OptionalEndpoint = None,
    experiment: ExperimentOption = "lingo-rl",
) -> None:
    """Pause a schedule (it starts no runs until resumed)."""
    _schedule_action(name, endpoint, experiment, "pause")


@schedule_app.command("resume")
@clear_errors
def schedule_resume(
    name: ScheduleName,
    endpoint: OptionalEndpoint = None,
    experiment: ExperimentOption = "lingo-rl",
) -> None:
    """Resume a paused schedule (missed intervals are not caught up)."""
    _schedule_action(name, endpoint, experiment, "resume")


@schedule_app.command("delete")
@clear_errors
def schedule_delete(
    name: ScheduleName,
    endpoint: OptionalEndpoint = None,
    experiment: ExperimentOption = "lingo-rl",
) -> None:
    """Delete a schedule (the runs it started stay)."""
    _schedule_action(name, endpoint, experiment, "delete")


@app.command()
@clear_errors
def status(
    run_id: Annotated[str, typer.Argument(help="The run id (lingo submit prints it).")],
    endpoint: EndpointOption,
    namespace: Annotated[
        str | None,
        typer.Option(
            help="Namespace of the run's training jobs (TrainJobs, PyTorchJobs), read with "
            "the kubeconfig [default: its context's namespace].",
        ),
    ] = None,
) -> None:
    """Show a run's state and its training jobs' (queued, running, …); exit 1 when the run
    FAILED or was CANCELED (a job Kueue has not admitted yet is queued, not failed)."""
    from pipelines.kfp_client import FAILED_STATES, KfpApiError, KfpConnection, get_run, run_url

    conn = KfpConnection.from_env(endpoint)
    try:
        run = get_run(conn, run_id)
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    echo(f"{run.run_id} {run.state} {run.display_name} {run_url(conn, run_id)}")
    if run.error:
        echo(f"error: {run.error}", err=True)
    for line in _run_jobs(run_id, namespace):
        echo(f"  {line}")
    if run.state in FAILED_STATES:
        raise typer.Exit(1)


def _run_jobs(run_id: str, namespace: str | None) -> list[str]:
    """``lingo status``'s job lines, or one line saying why they could not be read."""
    try:
        from kubernetes import config as k8s_config

        from cluster.launcher import NoKubernetesAccess, default_api_client
        from cluster.step_job import current_namespace, describe_run_jobs
    except ImportError as exc:
        return [f"training jobs not read: {exc.msg} (pip install 'lingo-rl[cluster]')"]
    try:
        api_client = default_api_client()
    except NoKubernetesAccess as exc:
        return [f"training jobs not read: {exc}"]
    if namespace is None:
        try:
            _, context = k8s_config.list_kube_config_contexts()
            namespace = context["context"].get("namespace", "default")
        except k8s_config.ConfigException:  # in a pod: its own namespace
            namespace = current_namespace()
    jobs = describe_run_jobs(namespace, api_client, run_id)
    return jobs or [f"no training job of this run in namespace {namespace}"]
