"""Recurring runs (``lingo schedule``) on a Kubeflow Pipelines server (REST API v2beta1).

A schedule is pinned: its ``pipeline_version_reference`` holds the pipeline *and* the version
uploaded when it was created, so a later ``lingo submit`` of another preset (a new version of
the same pipeline) does not change what it runs. With only ``pipeline_id`` the server resolves
the latest version at every trigger (the UI's "always use the latest version"), which is what
``lingo schedule`` did before.

Schedules are known by name within their experiment: scheduling a name that exists replaces
it (the new one is created disabled, the old ones deleted, then the new one enabled: never two
enabled, and a refused create leaves the old one in place). v2beta1 has no update call for
recurring runs.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pipelines.kfp_client import (
    DEFAULT_EXPERIMENT,
    DEFAULT_PIPELINE_NAME,
    KfpConnection,
    PipelineVersionRef,
    compile_preset,
    cron_with_seconds,
    get_or_create_experiment,
    name_filter,
    upload_pipeline,
)
from pipelines.presets import Preset
from pipelines.run_form import form_arguments

logger = logging.getLogger(__name__)


class ScheduleNotFoundError(LookupError):
    """No recurring run with that name (or id)."""


@dataclass(frozen=True)
class Schedule:
    """A recurring run as the server stores it (the fields ``lingo schedule list`` shows)."""

    recurring_run_id: str
    display_name: str
    status: str
    cron: str
    pipeline_id: str
    pipeline_version_id: str | None
    """None: the pipeline's latest version at each trigger (not pinned)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    experiment_id: str | None = None
    created_at: str | None = None

    @classmethod
    def from_api(cls, body: dict) -> Schedule:
        """From a v2beta1 ``RecurringRun`` JSON object."""
        trigger = body.get("trigger") or {}
        cron = (trigger.get("cron_schedule") or {}).get("cron")
        if cron is None and trigger.get("periodic_schedule"):
            cron = f"every {trigger['periodic_schedule'].get('interval_second')} s"
        reference = body.get("pipeline_version_reference") or {}
        return cls(
            recurring_run_id=body["recurring_run_id"],
            display_name=body.get("display_name", ""),
            status=body.get("status") or "STATUS_UNSPECIFIED",
            cron=cron or "",
            pipeline_id=reference.get("pipeline_id", ""),
            pipeline_version_id=reference.get("pipeline_version_id") or None,
            parameters=(body.get("runtime_config") or {}).get("parameters") or {},
            experiment_id=body.get("experiment_id"),
            created_at=body.get("created_at"),
        )


def create_recurring_run(
    conn: KfpConnection,
    version: PipelineVersionRef,
    experiment_id: str,
    cron: str,
    parameters: dict[str, Any],
    display_name: str,
    max_concurrency: int = 1,
    enabled: bool = True,
) -> Schedule:
    """A recurring run of ``version`` (pinned) on ``cron``; missed intervals are not caught
    up (``no_catchup``), at most ``max_concurrency`` runs at a time."""
    body = {
        "display_name": display_name,
        "experiment_id": experiment_id,
        "pipeline_version_reference": version.as_body(),
        "runtime_config": {"parameters": parameters},
        "trigger": {"cron_schedule": {"cron": cron_with_seconds(cron)}},
        "mode": "ENABLE" if enabled else "DISABLE",
        "max_concurrency": str(max_concurrency),
        "no_catchup": True,
    }
    created = Schedule.from_api(conn.request("POST", "/recurringruns", body=body))
    logger.info("created recurring run %s (%s)", display_name, created.recurring_run_id)
    return created


def list_schedules(
    conn: KfpConnection, experiment_id: str | None = None, name: str | None = None
) -> list[Schedule]:
    """The recurring runs (of one experiment, of one name), oldest first, every page."""
    params: dict[str, str] = {"page_size": "100", "sort_by": "created_at"}
    if experiment_id:
        params["experiment_id"] = experiment_id
    elif conn.namespace:
        params["namespace"] = conn.namespace
    if name is not None:
        params["filter"] = name_filter(name)
    schedules: list[Schedule] = []
    while True:
        page = conn.request("GET", "/recurringruns", params=params)
        # the proto field is ``recurringRuns`` (ListRecurringRunsResponse), not snake case
        schedules += [Schedule.from_api(r) for r in page.get("recurringRuns") or []]
        if not page.get("next_page_token"):
            return schedules
        params["page_token"] = page["next_page_token"]


def find_experiment(conn: KfpConnection, name: str) -> str | None:
    """The id of the experiment called ``name``, or None (nothing is created)."""
    params = {"filter": name_filter(name), "page_size": "2"}
    if conn.namespace:
        params["namespace"] = conn.namespace
    experiments = conn.request("GET", "/experiments", params=params).get("experiments") or []
    return experiments[0]["experiment_id"] if experiments else None


def resolve_schedules(conn: KfpConnection, name_or_id: str, experiment: str) -> list[Schedule]:
    """The recurring runs called ``name_or_id`` in ``experiment``, else the one with that id.

    Raises:
        ScheduleNotFoundError: neither.
    """
    experiment_id = find_experiment(conn, experiment)
    if experiment_id is not None:
        named = list_schedules(conn, experiment_id, name_or_id)
        if named:
            return named
    from pipelines.kfp_client import KfpApiError

    try:
        body = conn.request("GET", f"/recurringruns/{quote(name_or_id, safe='')}")
    except KfpApiError as exc:
        if exc.status != 404:
            raise
        raise ScheduleNotFoundError(
            f"no schedule named {name_or_id!r} in experiment {experiment!r} and no recurring "
            "run with that id (lingo schedule list shows them)"
        ) from None
    return [Schedule.from_api(body)]


def set_enabled(conn: KfpConnection, schedule: Schedule, enabled: bool) -> None:
    """Resume (``:enable``) or pause (``:disable``) a recurring run."""
    verb = "enable" if enabled else "disable"
    conn.request("POST", f"/recurringruns/{quote(schedule.recurring_run_id, safe='')}:{verb}")
    logger.info("%sd recurring run %s", verb, schedule.recurring_run_id)


def delete_schedule(conn: KfpConnection, schedule: Schedule) -> None:
    """Delete a recurring run (the runs it started stay)."""
    conn.request("DELETE", f"/recurringruns/{quote(schedule.recurring_run_id, safe='')}")
    logger.info("deleted recurring run %s", schedule.recurring_run_id)


@dataclass(frozen=True)
class SchedulePlan:
    """What ``lingo schedule`` creates: shown by ``--dry-run``, then carried out."""

    name: str
    pipeline_name: str
    preset: str
    cron: str
    """KFP's 6-field cron."""
    experiment: str
    parameters: dict[str, Any]
    replaces: tuple[Schedule, ...] = ()

    def render(self, version: PipelineVersionRef | None = None) -> str:
        """The plan as lines; ``version``: the uploaded version, None before the upload."""
        pinned = (
            f"{version.pipeline_id} version {version.pipeline_version_id} (pinned)"
            if version is not None
            else f"a new version of pipeline {self.pipeline_name!r} compiled from preset "
            f"{self.preset!r}, uploaded and pinned when the schedule is created"
        )
        lines = [
            f"schedule {self.name!r} in experiment {self.experiment!r}",
            f"  pipeline: {self.pipeline_name} → {pinned}",
            f"  cron: {self.cron} (KFP's 6 fields, seconds first; no catch-up, 1 run at a time)",
            "  parameters:",
            *(f"    {key} = {value!r}" for key, value in self.parameters.items()),
        ]
        if self.replaces:
            ids = ", ".join(s.recurring_run_id for s in self.replaces)
            lines.append(f"  replaces: {ids} (same name)")
        return "\n".join(lines)


def plan_schedule(
    conn: KfpConnection,
    preset: Preset,
    cron: str,
    name: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    pipeline_name: str = DEFAULT_PIPELINE_NAME,
) -> SchedulePlan:
    """What scheduling ``preset`` would create and replace; reads the server, writes nothing.

    Raises:
        ValueError: ``cron`` is not a 5- or 6-field cron expression.
    """
    name = name or f"{preset.name}-recurring"
    experiment_id = find_experiment(conn, experiment)
    existing = list_schedules(conn, experiment_id, name) if experiment_id else []
    return SchedulePlan(
        name=name,
        pipeline_name=pipeline_name,
        preset=preset.name,
        cron=cron_with_seconds(cron),
        experiment=experiment,
        parameters=form_arguments(preset),
        replaces=tuple(existing),
    )


def schedule_preset(
    conn: KfpConnection, preset: Preset, plan: SchedulePlan
) -> tuple[Schedule, PipelineVersionRef]:
    """Carry out ``plan``: upload ``preset``'s pipeline as a new version, create the schedule
    pinned to it, replace the schedules of the same name.

    Returns:
        The new schedule (enabled) and the version it runs.
    """
    with tempfile.TemporaryDirectory(prefix="lingo-schedule-") as tmp:
        version = upload_pipeline(conn, compile_preset(preset, Path(tmp)), plan.pipeline_name)
    experiment_id = get_or_create_experiment(conn, plan.experiment)
    replaced = list_schedules(conn, experiment_id, plan.name)  # as of now, not as planned
    created = create_recurring_run(
        conn,
        version,
        experiment_id,
        plan.cron,
        plan.parameters,
        plan.name,
        enabled=not replaced,
    )
    if replaced:
        for old in replaced:
            delete_schedule(conn, old)
        set_enabled(conn, created, True)
    return get_schedule(conn, created.recurring_run_id), version


def get_schedule(conn: KfpConnection, recurring_run_id: str) -> Schedule:
    """The recurring run ``recurring_run_id`` as the server has it now."""
    return Schedule.from_api(conn.request("GET", f"/recurringruns/{quote(recurring_run_id)}"))
