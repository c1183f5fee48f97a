"""Submit and watch the pipeline on a Kubeflow Pipelines server (REST API v2beta1); schedules:
``pipelines.schedules``.

Plain ``requests`` calls rather than ``kfp.Client``: the client loads kube config and
``~/.config/kfp/context.json`` on construction, health-checks the server and raises
``ApiException`` dumps; here every call is one visible request and every error names the
endpoint, the HTTP status and the server's message.

The bearer token, when the server needs one, comes from the environment variable ``KFP_TOKEN``
(e.g. ``oc whoami -t`` on OpenShift AI); it is sent as ``Authorization: Bearer …`` and never
logged or shown in errors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import requests

from pipelines.presets import Preset
from pipelines.run_form import form_arguments

logger = logging.getLogger(__name__)

TOKEN_ENV = "KFP_TOKEN"
API = "/apis/v2beta1"
DEFAULT_PIPELINE_NAME = "lingo-rl"
DEFAULT_EXPERIMENT = "lingo-rl"
TERMINAL_STATES = frozenset({"SUCCEEDED", "SKIPPED", "FAILED", "CANCELED"})
"""Run states after which a run does not change (v2beta1 ``RuntimeState``)."""
FAILED_STATES = frozenset({"FAILED", "CANCELED"})


class KfpEndpointError(ValueError):
    """The KFP endpoint (``--endpoint``, ``$KFP_ENDPOINT``) or its CA bundle is not usable."""


class CronError(ValueError):
    """A schedule that KFP's scheduler (robfig/cron, seconds first) would not accept."""


class KfpApiError(RuntimeError):
    """A KFP REST call that failed: names the method, URL, HTTP status and server message."""

    def __init__(self, method: str, url: str, status: int | None, message: str) -> None:
        self.method, self.url, self.status, self.message = method, url, status, message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"KFP {method} {url} failed ({where}): {message}")


class RunFailedError(RuntimeError):
    """A run that ended FAILED or CANCELED."""


@dataclass(frozen=True)
class KfpConnection:
    """Where the KFP API server is and how to authenticate to it.

    Attributes:
        endpoint: Base URL of the KFP API (``https://ds-pipeline-dspa-ns.apps.example.com``),
            without ``/apis/...``.
        token: Bearer token, or None for an unauthenticated server. Never shown in ``repr``.
        namespace: Kubernetes namespace of a multi-user deployment, else None.
        timeout_s: Per-request timeout.
        ca_bundle: PEM file of the CAs that sign the server's certificate (a cluster's own
            CA, e.g. a workbench's ``/etc/pki/tls/custom-certs/ca-bundle.crt``); None: the
            system's CAs.
    """

    endpoint: str
    token: str | None = field(default=None, repr=False)
    namespace: str | None = None
    timeout_s: float = 60.0
    ca_bundle: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KfpEndpointError(
                f"KFP endpoint {self.endpoint!r} (--endpoint or $KFP_ENDPOINT) is not an "
                "http:// or https:// URL with a host, e.g. https://ds-pipeline-dspa.example.com"
            )
        if self.ca_bundle is not None and not Path(self.ca_bundle).is_file():
            raise KfpEndpointError(f"KFP CA bundle {self.ca_bundle!r}: no such file")
        object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))

    @classmethod
    def from_env(cls, endpoint: str, namespace: str | None = None) -> KfpConnection:
        """A connection whose token is read from ``$KFP_TOKEN`` (unset or empty: no token)."""
        return cls(endpoint, token=os.environ.get(TOKEN_ENV) or None, namespace=namespace)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        files: dict[str, tuple[str, bytes, str]] | None = None,
    ) -> dict[str, Any]:
        """One REST call; the decoded JSON response (``{}`` when empty).

        Raises:
            KfpApiError: the server is unreachable or answers a non-2xx status.
        """
        url = f"{self.endpoint}{API}{path}"
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        logger.debug("KFP %s %s", method, url)
        try:
            response = requests.request(
                method,
                url,
                json=body,
                params=params,
                files=files,
                headers=headers,
                timeout=self.timeout_s,
                verify=self.ca_bundle or True,
            )
        except requests.RequestException as exc:
            raise KfpApiError(method, url, None, f"{type(exc).__name__}: {exc}") from None
        if not response.ok:
            raise KfpApiError(method, url, response.status_code, _error_message(response))
        return response.json() if response.content else {}


def _error_message(response: requests.Response) -> str:
    """The server's message from a grpc-gateway error body, else the raw text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason
    if isinstance(data, dict):
        return str(data.get("message") or data.get("error") or data)[:500]
    return str(data)[:500]


def name_filter(name: str) -> str:
    """A v2beta1 list filter (``filter.proto``) matching ``display_name == name``."""
    predicate = {"operation": "EQUALS", "key": "display_name", "string_value": name}
    return json.dumps({"predicates": [predicate]})


@dataclass(frozen=True)
class PipelineVersionRef:
    """A pipeline and one of its versions, as ``pipeline_version_reference`` wants them."""

    pipeline_id: str
    pipeline_version_id: str

    def as_body(self) -> dict[str, str]:
        """The JSON of a v2beta1 ``PipelineVersionReference``."""
        return {"pipeline_id": self.pipeline_id, "pipeline_version_id": self.pipeline_version_id}


def find_pipeline(conn: KfpConnection, name: str) -> str | None:
    """The id of the pipeline called ``name``, or None when there is none."""
    params = {"filter": name_filter(name), "page_size": "2"}
    if conn.namespace:
        params["namespace"] = conn.namespace
    pipelines = conn.request("GET", "/pipelines", params=params).get("pipelines") or []
    return pipelines[0]["pipeline_id"] if pipelines else None


def _version_name(pipeline_name: str, package: bytes) -> str:
    """A unique, traceable version name: the pipeline, UTC time and the YAML's hash."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{pipeline_name}-{stamp}-{hashlib.sha256(package).hexdigest()[:8]}"


def upload_pipeline(
    conn: KfpConnection, yaml_path: Path, name: str = DEFAULT_PIPELINE_NAME
) -> PipelineVersionRef:
    """Upload compiled pipeline YAML: a new pipeline, or a new version of the existing one.

    Args:
        conn: The KFP server.
        yaml_path: Compiled pipeline (``lingo compile``).
        name: The pipeline's name on the server.

    Returns:
        The pipeline and the version just uploaded.
    """
    package = Path(yaml_path).read_bytes()
    files = {"uploadfile": (Path(yaml_path).name, package, "application/x-yaml")}
    pipeline_id = find_pipeline(conn, name)
    if pipeline_id is None:
        params = {"name": name, "display_name": name}
        if conn.namespace:
            params["namespace"] = conn.namespace
        pipeline_id = conn.request("POST", "/pipelines/upload", params=params, files=files)[
            "pipeline_id"
        ]
        versions = (
            conn.request(
                "GET",
                f"/pipelines/{pipeline_id}/versions",
                params={"page_size": "1", "sort_by": "created_at desc"},
            ).get("pipeline_versions")
            or []
        )
        if not versions:
            raise KfpApiError(
                "GET",
                f"{conn.endpoint}{API}/pipelines/{pipeline_id}/versions",
                200,
                "the uploaded pipeline has no version",
            )
        version_id = versions[0]["pipeline_version_id"]
        logger.info("uploaded new pipeline %s (%s), version %s", name, pipeline_id, version_id)
    else:
        version = _version_name(name, package)
        params = {"name": version, "display_name": version, "pipelineid": pipeline_id}
        version_id = conn.request("POST", "/pipelines/upload_version", params=params, files=files)[
            "pipeline_version_id"
        ]
        logger.info("uploaded version %s (%s) of pipeline %s", version, version_id, name)
    return PipelineVersionRef(pipeline_id, version_id)


def get_or_create_experiment(conn: KfpConnection, name: str = DEFAULT_EXPERIMENT) -> str:
    """The id of the experiment called ``name``, created when missing."""
    params = {"filter": name_filter(name), "page_size": "2"}
    if conn.namespace:
        params["namespace"] = conn.namespace
    experiments = conn.request("GET", "/experiments", params=params).get("experiments") or []
    if experiments:
        return experiments[0]["experiment_id"]
    body = {"display_name": name}
    if conn.namespace:
        body["namespace"] = conn.namespace
    experiment_id = conn.request("POST", "/experiments", body=body)["experiment_id"]
    logger.info("created experiment %s (%s)", name, experiment_id)
    return experiment_id


def create_run(
    conn: KfpConnection,
    version: PipelineVersionRef,
    experiment_id: str,
    parameters: dict[str, Any],
    display_name: str,
) -> str:
    """Start one run of ``version`` with ``parameters``; returns the run id."""
    body = {
        "display_name": display_name,
        "experiment_id": experiment_id,
        "pipeline_version_reference": version.as_body(),
        "runtime_config": {"parameters": parameters},
    }
    run_id = conn.request("POST", "/runs", body=body)["run_id"]
    logger.info("created run %s: %s", run_id, run_url(conn, run_id))
    return run_id


def cron_with_seconds(cron: str) -> str:
    """KFP's 6-field cron (seconds first, robfig/cron); a 5-field crontab gets ``0`` seconds.

    Each field is checked as robfig/cron (which KFP's ScheduledWorkflow controller parses
    schedules with) reads it: ``*``, ``?`` (day of month and week), numbers in the field's
    range, ``a-b`` ranges, ``/step`` and ``,`` lists, month and weekday names; or a
    descriptor (``@daily``, ``@every 1h``).

    Raises:
        CronError: not 5 or 6 space-separated fields, or a field out of its range; the message
            names the field.
    """
    given = cron.strip()
    if given.startswith("@"):
        if given in CRON_DESCRIPTORS or re.fullmatch(r"@every \d+[a-z0-9.]*", given):
            return given
        raise CronError(
            f"cron {cron!r}: not a descriptor KFP knows "
            f"({', '.join(CRON_DESCRIPTORS)}, @every DURATION)"
        )
    fields = cron.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise CronError(
            f"cron {cron!r}: expected 5 fields (min hour dom month dow) or KFP's 6 (sec min "
            "hour dom month dow)"
        )
    for text, (name, low, high, names) in zip(fields, CRON_FIELDS, strict=True):
        question = name in ("day of month", "day of week")
        if problem := _cron_field_problem(text, low, high, names, question):
            raise CronError(
                f"cron {cron!r}: {name} {text!r}: {problem} (KFP's cron: sec min hour dom "
                f"month dow; {name} runs {low}-{high})"
            )
    return " ".join(fields)


CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
WEEKDAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
CRON_FIELDS = (
    ("second", 0, 59, {}),
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {m: i + 1 for i, m in enumerate(MONTHS)}),
    ("day of week", 0, 6, {d: i for i, d in enumerate(WEEKDAYS)}),
)
"""robfig/cron's fields, seconds first, each with its range and names."""


def _cron_field_problem(
    text: str, low: int, high: int, names: dict[str, int], question: bool
) -> str | None:
    """Why robfig/cron would refuse ``text`` for a field of range ``low``-``high``, or None."""

    def number(part: str) -> int | None:
        if part.upper() in names:
            return names[part.upper()]
        return int(part) if part.isdigit() else None

    for item in text.split(","):
        span, _, step = item.partition("/")
        if step and (not step.isdigit() or int(step) == 0):
            return f"step {step!r} is not a positive number"
        if span in ("*", "?"):
            if span == "?" and not question:
                return "'?' is for the day of month or week only"
            continue
        first, _, last = span.partition("-")
        values = [number(first)] + ([number(last)] if last else [])
        if None in values:
            return f"{span!r} is not a number"
        if any(not low <= v <= high for v in values):
            return f"{span!r} is out of range"
        if last and values[0] > values[1]:
            return f"{span!r} runs backwards"
    return None


@dataclass(frozen=True)
class RunStatus:
    """What ``GET /runs/{id}`` says about a run."""

    run_id: str
    display_name: str
    state: str
    error: str | None
    created_at: str | None
    finished_at: str | None

    @property
    def done(self) -> bool:
        """Whether the run reached a terminal state."""
        return self.state in TERMINAL_STATES


def get_run(conn: KfpConnection, run_id: str) -> RunStatus:
    """The current state of run ``run_id``."""
    run = conn.request("GET", f"/runs/{quote(run_id, safe='')}")
    error = run.get("error") or {}
    return RunStatus(
        run_id=run.get("run_id", run_id),
        display_name=run.get("display_name", ""),
        state=run.get("state") or "RUNTIME_STATE_UNSPECIFIED",
        error=error.get("message") or None,
        created_at=run.get("created_at"),
        finished_at=run.get("finished_at"),
    )


def wait_for_run(
    conn: KfpConnection,
    run_id: str,
    poll_s: float = 15.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> RunStatus:
    """Poll run ``run_id`` until it ends.

    Returns:
        The final status of a SUCCEEDED or SKIPPED run.

    Raises:
        RunFailedError: the run ended FAILED or CANCELED (with the server's error message).
        TimeoutError: ``timeout_s`` passed first.
    """
    start = time.monotonic()
    last_state = None
    while True:
        status = get_run(conn, run_id)
        if status.state != last_state:
            logger.info("run %s: %s", run_id, status.state)
            last_state = status.state
        if status.state in FAILED_STATES:
            raise RunFailedError(
                f"run {run_id} {status.state}: {status.error or 'no error message'} "
                f"({run_url(conn, run_id)})"
            )
        if status.done:
            return status
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"run {run_id} still {status.state} after {timeout_s:.0f} s")
        sleep(poll_s)


def run_url(conn: KfpConnection, run_id: str) -> str:
    """The run's page in the KFP UI."""
    return f"{conn.endpoint}/#/runs/details/{quote(run_id, safe='')}"


@dataclass(frozen=True)
class SubmittedRun:
    """A run started by :func:`submit_preset`."""

    run_id: str
    version: PipelineVersionRef
    experiment_id: str
    url: str


def compile_preset(preset: Preset, workdir: Path) -> Path:
    """The pipeline YAML of ``preset``, written to ``workdir/lingo_pipeline.yaml``."""
    from pipelines.compile import compile_pipeline

    return compile_pipeline(workdir / "lingo_pipeline.yaml", preset)


def submit_preset(
    conn: KfpConnection,
    preset: Preset,
    experiment: str = DEFAULT_EXPERIMENT,
    pipeline_name: str = DEFAULT_PIPELINE_NAME,
    run_name: str | None = None,
) -> SubmittedRun:
    """Compile the pipeline for ``preset``, upload it as a new version and start a run.

    The run's parameters are the preset's form (``form_arguments``: its fields as ``--set``
    left them); every other ``--set`` value is in the version's preset.
    """
    with tempfile.TemporaryDirectory(prefix="lingo-submit-") as tmp:
        version = upload_pipeline(conn, compile_preset(preset, Path(tmp)), pipeline_name)
    experiment_id = get_or_create_experiment(conn, experiment)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run_id = create_run(
        conn,
        version,
        experiment_id,
        form_arguments(preset),
        run_name or f"{preset.name}-{stamp}",
    )
    return SubmittedRun(run_id, version, experiment_id, run_url(conn, run_id))
