"""A Kubeflow Pipelines v2beta1 REST server for tests: what the stock ``kfp`` 2.17 client and
``pipelines.kfp_client`` send and read.

No KFP API server can run here (it needs Kubernetes, MySQL and Argo), so this is an emulator: a
real ``http.server`` on 127.0.0.1 that keeps pipelines, versions, experiments, runs and recurring
runs in memory, records every call, and answers as the KFP API server does:

- Field names are the proto names (``display_name``), as the server writes them; request bodies
  are read with either the proto or the lowerCamel name (protojson accepts both) and checked
  field by field, type by type, against the ``kfp_server_api`` models (the generated client of
  the same API): an unknown field, a wrong type, an enum value the API does not have, or a
  timestamp that is not RFC 3339 is a 400. (The server would drop an unknown field silently;
  here it fails the test, which is the point.)
- ``filter`` is a JSON ``Filter`` proto, read as the server's ``jsonpb`` does: ``string_value``
  or ``stringValue``, ``operation`` as a name (``"EQUALS"``) or a number (``1``); an unknown
  key is a 400. The server URL-unescapes the (already decoded) query value once more, and so
  does this one.
- Timestamps are RFC 3339 UTC (``2026-12-06T13:45:07Z``); an unfinished run's ``finished_at``
  is the zero time ``1970-01-01T00:00:00Z``, as the server writes it.
- A run's ``runtime_config.parameters`` must be inputs of the pipeline's root, of its type
  (``NUMBER_INTEGER``, ``STRUCT``, ...), and every input without a default must be given. The
  server finds a wrong parameter only when the run's root driver starts; this emulator refuses
  it at ``POST /runs`` (a 400), so a wrong command fails at once.
- An empty list is ``{}`` (the server omits empty fields), errors are grpc-gateway's
  ``{"error", "code", "message", "details"}``.

How runs progress is set by ``run_states``: each ``GET /runs/{id}`` of a run returns the next
entry (the last one repeats), e.g. ``[{"state": "RUNNING"}, {"state": "SUCCEEDED"}]`` or
``[{"state": "FAILED", "error": {"code": 2, "message": "sft OOMKilled"}}]``. ``on_run_done(run)``
is called once when a run first reaches a terminal state (to write what the run outputs, e.g.
a ``training_metrics.jsonl`` on a "shared volume" folder). ``trigger_recurring_run(id)`` starts
the run a recurring run's cron would start (the server's ScheduledWorkflow controller has no
REST route): its pinned version, or the pipeline's latest version at that moment.

Use:

    with kfp_emulator() as kfp:          # tests
        client = kfp_server_api ... kfp.endpoint ...

    python -m tests.kfp_emulator --port 8888            # a standalone server
    python -m tests.kfp_emulator --port 8888 --states RUNNING,SUCCEEDED
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from email import policy
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote_plus, urlsplit

import kfp_server_api
import yaml

API = "/apis/v2beta1"
TERMINAL_STATES = ("SUCCEEDED", "SKIPPED", "FAILED", "CANCELED")
ZERO_TIME = "1970-01-01T00:00:00Z"
DEFAULT_RUN_STATES = ({"state": "RUNNING"}, {"state": "SUCCEEDED"})

# grpc codes (google.rpc.Code) and the HTTP status grpc-gateway maps each to
INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, UNAUTHENTICATED = 3, 5, 6, 16
HTTP_STATUS = {INVALID_ARGUMENT: 400, NOT_FOUND: 404, ALREADY_EXISTS: 409, UNAUTHENTICATED: 401}

FILTER_OPERATIONS = {
    "EQUALS": 1,
    "NOT_EQUALS": 2,
    "GREATER_THAN": 3,
    "GREATER_THAN_EQUALS": 5,
    "LESS_THAN": 6,
    "LESS_THAN_EQUALS": 7,
    "IN": 8,
    "IS_SUBSTRING": 9,
}
"""``filter.proto``'s ``Predicate.Operation`` (the kfp client's ``_FILTER_OPERATIONS``)."""
PREDICATE_VALUES = {
    "int_value": "intValue",
    "long_value": "longValue",
    "string_value": "stringValue",
    "timestamp_value": "timestampValue",
    "int_values": "intValues",
    "long_values": "longValues",
    "string_values": "stringValues",
}

INT64_FIELDS = {
    ("V2beta1RecurringRun", "max_concurrency"),
    ("V2beta1PeriodicSchedule", "interval_second"),
    ("V2beta1Predicate", "long_value"),
    ("PredicateLongValues", "values"),
}
"""The int64 fields of the v2beta1 protos: the generated models type them ``str`` (protojson
writes an int64 as a decimal string) but the server reads a JSON number as well."""

PARAMETER_TYPES: dict[str, Callable[[Any], bool]] = {
    "STRING": lambda v: isinstance(v, str),
    "NUMBER_INTEGER": lambda v: (
        isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer()
    ),
    "NUMBER_DOUBLE": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "BOOLEAN": lambda v: isinstance(v, bool),
    "STRUCT": lambda v: isinstance(v, dict),
    "LIST": lambda v: isinstance(v, list),
}
"""How a ``google.protobuf.Value`` must look for each ``parameterType`` of a pipeline input."""


class ApiError(Exception):
    """A grpc status the handler turns into a grpc-gateway error response."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def now() -> str:
    """The current time as the server writes timestamps (RFC 3339, UTC, seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def check_model(body: Any, model: str, where: str = "") -> dict:
    """``body`` read as ``kfp_server_api`` model ``model``; the same data with proto names.

    Raises:
        ApiError: INVALID_ARGUMENT naming the field that is unknown or of the wrong type.
    """
    where = where or model
    cls = getattr(kfp_server_api, model)
    if hasattr(cls, "allowable_values"):  # an enum: a name (or the number of one)
        values = cls.allowable_values
        if isinstance(body, int) and not isinstance(body, bool) and 0 <= body < len(values):
            return values[body]
        if body not in values:
            raise ApiError(INVALID_ARGUMENT, f"{where}: {body!r} is not one of {values}")
        return body
    if not isinstance(body, dict):
        raise ApiError(INVALID_ARGUMENT, f"{where}: expected a JSON object ({model})")
    attr_of = {}  # a JSON name, proto or lowerCamel -> (proto name, model attribute)
    for attr, key in cls.attribute_map.items():
        attr_of[key] = attr_of[_camel(key)] = (key, attr)
    out = {}
    for key, value in body.items():
        if key not in attr_of:
            raise ApiError(INVALID_ARGUMENT, f'{where}: unknown field "{key}" ({model})')
        name, attr = attr_of[key]
        kind = cls.openapi_types[attr]
        if (model, attr) in INT64_FIELDS:
            kind = kind.replace("str", "int64")
        if value is not None:
            out[name] = _check_type(value, kind, f"{where}.{name}")
    return out


def _check_type(value: Any, kind: str, where: str) -> Any:
    if kind.startswith("list["):
        if not isinstance(value, list):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected a list")
        return [_check_type(v, kind[5:-1], f"{where}[{i}]") for i, v in enumerate(value)]
    if kind.startswith("dict("):
        if not isinstance(value, dict):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected an object")
        sub = re.match(r"dict\([^,]*, (.*)\)", kind).group(1)
        return {k: _check_type(v, sub, f"{where}.{k}") for k, v in value.items()}
    if kind == "str":
        if not isinstance(value, str):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected a string, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected true or false, got {value!r}")
        return value
    if kind in ("int", "int64"):  # a JSON number or a decimal string; int64 written as a string
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit())
        ):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected an integer, got {value!r}")
        return str(value) if kind == "int64" else int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected a number, got {value!r}")
        return value
    if kind == "datetime":
        if not isinstance(value, str):
            raise ApiError(INVALID_ARGUMENT, f"{where}: expected an RFC 3339 timestamp")
        try:
            datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ApiError(
                INVALID_ARGUMENT, f"{where}: {value!r} is not an RFC 3339 timestamp"
            ) from None
        return value
    if kind == "object":
        return value
    return check_model(value, kind, where)


def parse_filter(raw: str | None) -> list[dict]:
    """The predicates of a ``filter`` query value, read as the server's ``jsonpb`` reads it.

    Each predicate comes back as ``{"op": NAME, "key": KEY, "value": VALUE}``.
    """
    if not raw:
        return []
    decoded = unquote_plus(raw)  # the server's url.QueryUnescape of the decoded value
    where = f"failed to parse valid filter from {raw!r}"
    try:
        data = json.loads(decoded)
    except ValueError as exc:
        raise ApiError(INVALID_ARGUMENT, f"{where}: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"predicates"}:
        raise ApiError(INVALID_ARGUMENT, f"{where}: a Filter has only 'predicates'")
    known = {"operation", "key", *PREDICATE_VALUES, *PREDICATE_VALUES.values()}
    predicates = []
    for predicate in data.get("predicates") or []:
        unknown = set(predicate) - known
        if unknown:
            raise ApiError(INVALID_ARGUMENT, f"{where}: unknown field {sorted(unknown)[0]!r}")
        op = predicate.get("operation")
        names = {v: k for k, v in FILTER_OPERATIONS.items()}
        if op in names:
            op = names[op]
        if op not in FILTER_OPERATIONS:
            raise ApiError(INVALID_ARGUMENT, f"{where}: unknown operation {op!r}")
        values = [
            predicate[name]
            for pair in PREDICATE_VALUES.items()
            for name in pair
            if name in predicate
        ]
        if len(values) != 1:
            raise ApiError(INVALID_ARGUMENT, f"{where}: a predicate needs exactly one value")
        value = values[0]
        if isinstance(value, dict):  # IntValues, StringValues, ...: {"values": [...]}
            value = value.get("values") or []
        predicates.append({"op": op, "key": predicate.get("key", ""), "value": value})
    return predicates


def _matches(item: dict, predicate: dict) -> bool:
    have, want = item.get(predicate["key"]), predicate["value"]
    if isinstance(have, int | float) and isinstance(want, str) and want.lstrip("-").isdigit():
        want = int(want)
    op = predicate["op"]
    if op == "EQUALS":
        return have == want
    if op == "NOT_EQUALS":
        return have != want
    if op == "IN":
        return have in want
    if op == "IS_SUBSTRING":
        return isinstance(have, str) and str(want) in have
    if have is None:
        return False
    return {
        "GREATER_THAN": have > want,
        "GREATER_THAN_EQUALS": have >= want,
        "LESS_THAN": have < want,
        "LESS_THAN_EQUALS": have <= want,
    }[op]


def check_parameters(spec: dict, parameters: dict) -> None:
    """``parameters`` against the root inputs of pipeline spec ``spec``.

    Raises:
        ApiError: INVALID_ARGUMENT naming the parameter that is unknown, missing or mistyped.
    """
    inputs = ((spec.get("root") or {}).get("inputDefinitions") or {}).get("parameters") or {}
    for name, value in parameters.items():
        if name not in inputs:
            raise ApiError(
                INVALID_ARGUMENT,
                f"parameter {name!r} is not an input of pipeline "
                f"{spec.get('pipelineInfo', {}).get('name')!r} (inputs: {', '.join(inputs)})",
            )
        kind = inputs[name].get("parameterType", "STRING")
        if not PARAMETER_TYPES.get(kind, lambda v: True)(value):
            raise ApiError(
                INVALID_ARGUMENT, f"parameter {name!r} is {kind}; got {json.dumps(value)[:80]}"
            )
    for name, definition in inputs.items():
        optional = definition.get("isOptional") or "defaultValue" in definition
        if name not in parameters and not optional:
            raise ApiError(INVALID_ARGUMENT, f"parameter {name!r} is required and not given")


def read_pipeline_package(data: bytes, where: str) -> dict:
    """The pipeline spec (first YAML document) of an uploaded package, checked for shape."""
    try:
        docs = list(yaml.safe_load_all(data))
    except yaml.YAMLError as exc:
        raise ApiError(INVALID_ARGUMENT, f"{where}: not YAML: {exc}") from None
    return _spec_of(docs[0] if docs else None, where)


def _spec_of(doc: Any, where: str) -> dict:
    if isinstance(doc, dict) and "pipeline_spec" in doc:  # {pipeline_spec, platform_spec}
        doc = doc["pipeline_spec"]
    if not isinstance(doc, dict) or not {"pipelineInfo", "root"} <= set(doc):
        raise ApiError(
            INVALID_ARGUMENT, f"{where}: not a KFP v2 pipeline spec (no pipelineInfo and root)"
        )
    return doc


class KfpEmulator:
    """State, recorded calls and HTTP server of the emulated KFP API.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT`` once started (the base URL, without ``/apis``).
        calls: Every request: ``method``, ``path``, ``query``, ``auth``, ``body``, ``files``.
        run_states: The states a run reports poll by poll (see the module docstring).
        on_run_done: Called with the run (a dict) when it first reaches a terminal state.
        token: When set, every call must carry ``Authorization: Bearer <token>`` (else 401),
            as behind OpenShift AI's oauth proxy; None: no authentication, as a port-forward.
    """

    def __init__(
        self,
        run_states: list[dict] | tuple[dict, ...] = DEFAULT_RUN_STATES,
        on_run_done: Callable[[dict], None] | None = None,
        multi_user: bool = False,
        token: str | None = None,
    ) -> None:
        self.run_states = list(run_states)
        self.token = token
        self.on_run_done = on_run_done
        self.multi_user = multi_user
        self.calls: list[dict] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, dict] = {}
        self.specs: dict[str, dict] = {}  # pipeline_version_id -> pipeline spec
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring_runs: dict[str, dict] = {}
        self.endpoint = ""
        self._polls: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None

    # -- the server ----------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> KfpEmulator:
        """Serve on ``host:port`` (0: a free port) in a daemon thread."""
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def set_run_states(self, states: list[dict]) -> None:
        """How runs created from now on (and runs not yet polled to the end) progress."""
        self.run_states = list(states)

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids):04d}"

    # -- requests -----------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict, body: Any, files: dict) -> dict:
        """The response body of one API call (``path`` without ``/apis/v2beta1``)."""
        with self._lock:
            for pattern, verb, name in ROUTES:
                match = re.fullmatch(pattern, path)
                if match and verb == method:
                    return getattr(self, name)(*match.groups(), query=query, body=body, files=files)
        raise ApiError(NOT_FOUND, f"Not Found: {method} {API}{path}")

    def healthz(self, **_: Any) -> dict:
        return {"multi_user": self.multi_user, "pipeline_store": "database"}

    def _list(self, items: list[dict], query: dict, field: str, id_key: str) -> dict:
        for predicate in parse_filter(query.get("filter")):
            items = [i for i in items if _matches(i, predicate)]
        sort_by = (query.get("sort_by") or "created_at").split()
        key = sort_by[0] if sort_by else "created_at"
        items = sorted(items, key=lambda i: (i.get(key) or "", i[id_key]))
        if len(sort_by) > 1 and sort_by[1] == "desc":
            items.reverse()
        start = int(query.get("page_token") or 0)
        size = int(query.get("page_size") or 20)
        page = items[start : start + size]
        if not page:
            return {}
        out = {field: copy.deepcopy(page), "total_size": len(items)}
        if start + size < len(items):
            out["next_page_token"] = str(start + size)
        return out

    def _get(self, table: dict, key: str, what: str) -> dict:
        if key not in table:
            raise ApiError(NOT_FOUND, f"{what} {key} not found")
        return table[key]

    # experiments

    def list_experiments(self, query: dict, **_: Any) -> dict:
        return self._list(list(self.experiments.values()), query, "experiments", "experiment_id")

    def get_experiment(self, experiment_id: str, **_: Any) -> dict:
        return self._get(self.experiments, experiment_id, "experiment")

    def create_experiment(self, body: Any, **_: Any) -> dict:
        experiment = check_model(body, "V2beta1Experiment", "experiment")
        name = experiment.get("display_name") or ""
        if not name:
            raise ApiError(INVALID_ARGUMENT, "experiment.display_name: must not be empty")
        if any(e["display_name"] == name for e in self.experiments.values()):
            raise ApiError(ALREADY_EXISTS, f"experiment {name!r} already exists")
        experiment = {
            **{k: v for k, v in experiment.items() if v != ""},
            "experiment_id": self._new_id("experiment"),
            "created_at": now(),
            "last_run_created_at": ZERO_TIME,
            "storage_state": "AVAILABLE",
        }
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def _set_experiment_state(self, experiment_id: str, state: str) -> dict:
        self.get_experiment(experiment_id)["storage_state"] = state
        return {}

    def archive_experiment(self, experiment_id: str, **_: Any) -> dict:
        return self._set_experiment_state(experiment_id, "ARCHIVED")

    def unarchive_experiment(self, experiment_id: str, **_: Any) -> dict:
        return self._set_experiment_state(experiment_id, "AVAILABLE")

    def delete_experiment(self, experiment_id: str, **_: Any) -> dict:
        self.get_experiment(experiment_id)
        del self.experiments[experiment_id]
        return {}

    # pipelines and versions

    def list_pipelines(self, query: dict, **_: Any) -> dict:
        return self._list(list(self.pipelines.values()), query, "pipelines", "pipeline_id")

    def get_pipeline(self, pipeline_id: str, **_: Any) -> dict:
        return self._get(self.pipelines, pipeline_id, "pipeline")

    def get_pipeline_by_name(self, name: str, **_: Any) -> dict:
        name = unquote_plus(name)
        for pipeline in self.pipelines.values():
            if pipeline["name"] == name:
                return pipeline
        raise ApiError(NOT_FOUND, f"pipeline named {name!r} not found")

    def delete_pipeline(self, pipeline_id: str, **_: Any) -> dict:
        self.get_pipeline(pipeline_id)
        if any(v["pipeline_id"] == pipeline_id for v in self.versions.values()):
            raise ApiError(
                9, f"pipeline {pipeline_id} has versions; delete them first"
            )  # FAILED_PRECONDITION
        del self.pipelines[pipeline_id]
        return {}

    def upload_pipeline(self, query: dict, files: dict, **_: Any) -> dict:
        package = self._package(files)
        spec = read_pipeline_package(package, "uploadfile")
        name = query.get("name") or spec["pipelineInfo"]["name"]
        if any(p["name"] == name for p in self.pipelines.values()):
            raise ApiError(ALREADY_EXISTS, f"pipeline with name {name!r} already exists")
        pipeline = {
            "pipeline_id": self._new_id("pipeline"),
            "name": name,
            "display_name": query.get("display_name") or name,
            "created_at": now(),
        }
        for key in ("description", "namespace"):
            if query.get(key):
                pipeline[key] = query[key]
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        self._add_version(pipeline["pipeline_id"], name, query.get("display_name") or name, spec)
        return pipeline

    def upload_pipeline_version(self, query: dict, files: dict, **_: Any) -> dict:
        package = self._package(files)
        pipeline_id = query.get("pipelineid") or ""
        self.get_pipeline(pipeline_id)
        spec = read_pipeline_package(package, "uploadfile")
        name = query.get("name") or spec["pipelineInfo"]["name"]
        return self._add_version(
            pipeline_id, name, query.get("display_name") or name, spec, query.get("description")
        )

    def _package(self, files: dict) -> bytes:
        if "uploadfile" not in files:
            raise ApiError(INVALID_ARGUMENT, "no multipart field 'uploadfile' in the upload")
        return files["uploadfile"]

    def _add_version(
        self, pipeline_id: str, name: str, display_name: str, spec: dict, description: str = ""
    ) -> dict:
        if any(
            v["pipeline_id"] == pipeline_id and v["name"] == name for v in self.versions.values()
        ):
            raise ApiError(ALREADY_EXISTS, f"pipeline version {name!r} already exists")
        version = {
            "pipeline_id": pipeline_id,
            "pipeline_version_id": self._new_id("version"),
            "name": name,
            "display_name": display_name,
            "created_at": now(),
            "pipeline_spec": spec,
        }
        if description:
            version["description"] = description
        self.versions[version["pipeline_version_id"]] = version
        self.specs[version["pipeline_version_id"]] = spec
        return version

    def list_pipeline_versions(self, pipeline_id: str, query: dict, **_: Any) -> dict:
        self.get_pipeline(pipeline_id)
        versions = [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]
        return self._list(versions, query, "pipeline_versions", "pipeline_version_id")

    def get_pipeline_version(self, pipeline_id: str, version_id: str, **_: Any) -> dict:
        version = self._get(self.versions, version_id, "pipeline version")
        if version["pipeline_id"] != pipeline_id:
            raise ApiError(NOT_FOUND, f"pipeline version {version_id} not found")
        return version

    def delete_pipeline_version(self, pipeline_id: str, version_id: str, **_: Any) -> dict:
        self.get_pipeline_version(pipeline_id, version_id)
        del self.versions[version_id]
        return {}

    def _latest_version(self, pipeline_id: str) -> dict:
        self.get_pipeline(pipeline_id)
        versions = [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]
        if not versions:
            raise ApiError(NOT_FOUND, f"pipeline {pipeline_id} has no version")
        return max(versions, key=lambda v: (v["created_at"], v["pipeline_version_id"]))

    def _spec_for(self, resource: dict, where: str) -> dict:
        """The pipeline spec a run or recurring run runs; its version reference resolved."""
        has_spec = "pipeline_spec" in resource
        reference = resource.get("pipeline_version_reference")
        if has_spec == bool(reference):
            raise ApiError(
                INVALID_ARGUMENT,
                f"{where}: give exactly one of pipeline_spec and pipeline_version_reference",
            )
        if has_spec:
            return _spec_of(resource["pipeline_spec"], f"{where}.pipeline_spec")
        if not reference.get("pipeline_id"):
            raise ApiError(
                INVALID_ARGUMENT, f"{where}.pipeline_version_reference.pipeline_id: empty"
            )
        version_id = reference.get("pipeline_version_id")
        if version_id:
            return self.specs[
                self.get_pipeline_version(reference["pipeline_id"], version_id)[
                    "pipeline_version_id"
                ]
            ]
        return self.specs[self._latest_version(reference["pipeline_id"])["pipeline_version_id"]]

    def _check_experiment(self, resource: dict) -> None:
        if resource.get("experiment_id"):
            self.get_experiment(resource["experiment_id"])

    # runs

    def create_run(self, body: Any, **_: Any) -> dict:
        run = check_model(body, "V2beta1Run", "run")
        for output in ("run_id", "created_at", "finished_at", "state", "state_history"):
            run.pop(output, None)  # output fields: the server ignores what a client sends
        spec = self._spec_for(run, "run")
        check_parameters(spec, (run.get("runtime_config") or {}).get("parameters") or {})
        self._check_experiment(run)
        if not run.get("display_name"):
            raise ApiError(INVALID_ARGUMENT, "run.display_name: must not be empty")
        reference = run.get("pipeline_version_reference")
        if reference and not reference.get("pipeline_version_id"):
            reference["pipeline_version_id"] = self._latest_version(reference["pipeline_id"])[
                "pipeline_version_id"
            ]
        created = now()
        run.update(
            run_id=self._new_id("run"),
            storage_state="AVAILABLE",
            created_at=created,
            scheduled_at=created,
            finished_at=ZERO_TIME,
            state="PENDING",
            state_history=[{"update_time": created, "state": "PENDING"}],
        )
        self.runs[run["run_id"]] = run
        if run.get("experiment_id"):
            self.experiments[run["experiment_id"]]["last_run_created_at"] = created
        self._polls[run["run_id"]] = 0
        return run

    def get_run(self, run_id: str, **_: Any) -> dict:
        run = self._get(self.runs, run_id, "run")
        if run["state"] not in TERMINAL_STATES and run_id in self._polls:
            states = self.run_states
            step = states[min(self._polls[run_id], len(states) - 1)]
            self._polls[run_id] += 1
            self._advance(run, step)
        return run

    def _advance(self, run: dict, step: dict) -> None:
        step = check_model(step, "V2beta1Run", "run_states")
        if step.get("state") and step["state"] != run["state"]:
            run["state_history"].append({"update_time": now(), "state": step["state"]})
        run.update(step)
        if run["state"] in TERMINAL_STATES:
            run["finished_at"] = now()
            self._polls.pop(run["run_id"], None)
            if self.on_run_done is not None:
                self.on_run_done(copy.deepcopy(run))

    def list_runs(self, query: dict, **_: Any) -> dict:
        runs = list(self.runs.values())
        if query.get("experiment_id"):
            runs = [r for r in runs if r.get("experiment_id") == query["experiment_id"]]
        return self._list(runs, query, "runs", "run_id")

    def _set_run_storage(self, run_id: str, state: str) -> dict:
        self._get(self.runs, run_id, "run")["storage_state"] = state
        return {}

    def archive_run(self, run_id: str, **_: Any) -> dict:
        return self._set_run_storage(run_id, "ARCHIVED")

    def unarchive_run(self, run_id: str, **_: Any) -> dict:
        return self._set_run_storage(run_id, "AVAILABLE")

    def delete_run(self, run_id: str, **_: Any) -> dict:
        self._get(self.runs, run_id, "run")
        del self.runs[run_id]
        return {}

    def terminate_run(self, run_id: str, **_: Any) -> dict:
        run = self._get(self.runs, run_id, "run")
        if run["state"] not in TERMINAL_STATES:
            self._advance(run, {"state": "CANCELED"})
        return {}

    # recurring runs

    def create_recurring_run(self, body: Any, **_: Any) -> dict:
        recurring = check_model(body, "V2beta1RecurringRun", "recurring_run")
        spec = self._spec_for(recurring, "recurring_run")
        check_parameters(spec, (recurring.get("runtime_config") or {}).get("parameters") or {})
        self._check_experiment(recurring)
        trigger = recurring.get("trigger") or {}
        if len(trigger) != 1:
            raise ApiError(
                INVALID_ARGUMENT,
                "recurring_run.trigger: give exactly one of cron_schedule and periodic_schedule",
            )
        cron = (trigger.get("cron_schedule") or {}).get("cron")
        if "cron_schedule" in trigger and (not cron or len(cron.split()) not in (6, 7)):
            raise ApiError(
                INVALID_ARGUMENT,
                f"recurring_run.trigger.cron_schedule.cron {cron!r}: the server's cron "
                "(robfig/cron with seconds) needs 6 fields, seconds first",
            )
        created = now()
        recurring.update(
            recurring_run_id=self._new_id("recurring"),
            created_at=created,
            updated_at=created,
            status="DISABLED" if recurring.get("mode") == "DISABLE" else "ENABLED",
        )
        recurring.setdefault("max_concurrency", "1")
        self.recurring_runs[recurring["recurring_run_id"]] = recurring
        return recurring

    def get_recurring_run(self, recurring_run_id: str, **_: Any) -> dict:
        return self._get(self.recurring_runs, recurring_run_id, "recurring run")

    def list_recurring_runs(self, query: dict, **_: Any) -> dict:
        items = list(self.recurring_runs.values())
        if query.get("experiment_id"):
            items = [r for r in items if r.get("experiment_id") == query["experiment_id"]]
        return self._list(items, query, "recurringRuns", "recurring_run_id")

    def _set_mode(self, recurring_run_id: str, mode: str, status: str) -> dict:
        recurring = self.get_recurring_run(recurring_run_id)
        recurring.update(mode=mode, status=status, updated_at=now())
        return {}

    def enable_recurring_run(self, recurring_run_id: str, **_: Any) -> dict:
        return self._set_mode(recurring_run_id, "ENABLE", "ENABLED")

    def disable_recurring_run(self, recurring_run_id: str, **_: Any) -> dict:
        return self._set_mode(recurring_run_id, "DISABLE", "DISABLED")

    def delete_recurring_run(self, recurring_run_id: str, **_: Any) -> dict:
        self.get_recurring_run(recurring_run_id)
        del self.recurring_runs[recurring_run_id]
        return {}

    def trigger_recurring_run(self, recurring_run_id: str) -> dict:
        """Start the run a trigger of the recurring run starts, as the server's
        ScheduledWorkflow controller does (no REST route: the cron fires it): the version its
        reference pins, else the pipeline's latest version *now*; its parameters; its
        experiment; ``recurring_run_id`` set. A paused (DISABLED) one starts nothing.

        Returns:
            The run.

        Raises:
            ApiError: it is paused (DISABLED): a paused schedule fires nothing.
        """
        with self._lock:
            recurring = self.get_recurring_run(recurring_run_id)
            if recurring["status"] != "ENABLED":
                raise ApiError(
                    INVALID_ARGUMENT, f"recurring run {recurring_run_id} is {recurring['status']}"
                )
            run = {
                key: copy.deepcopy(recurring[key])
                for key in ("experiment_id", "runtime_config", "pipeline_spec", "service_account")
                if key in recurring
            }
            if "pipeline_version_reference" in recurring:
                run["pipeline_version_reference"] = dict(recurring["pipeline_version_reference"])
            stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
            run["display_name"] = f"{recurring['display_name']}-{stamp}"
            created = self.create_run(run)
            created["recurring_run_id"] = recurring_run_id
            return created


_ID = r"([^/:]+)"
ROUTES: list[tuple[str, str, str]] = [
    (r"/healthz", "GET", "healthz"),
    (r"/experiments", "GET", "list_experiments"),
    (r"/experiments", "POST", "create_experiment"),
    (rf"/experiments/{_ID}", "GET", "get_experiment"),
    (rf"/experiments/{_ID}", "DELETE", "delete_experiment"),
    (rf"/experiments/{_ID}:archive", "POST", "archive_experiment"),
    (rf"/experiments/{_ID}:unarchive", "POST", "unarchive_experiment"),
    (r"/pipelines", "GET", "list_pipelines"),
    (r"/pipelines/upload", "POST", "upload_pipeline"),
    (r"/pipelines/upload_version", "POST", "upload_pipeline_version"),
    (rf"/pipelines/names/{_ID}", "GET", "get_pipeline_by_name"),
    (rf"/pipelines/{_ID}", "GET", "get_pipeline"),
    (rf"/pipelines/{_ID}", "DELETE", "delete_pipeline"),
    (rf"/pipelines/{_ID}/versions", "GET", "list_pipeline_versions"),
    (rf"/pipelines/{_ID}/versions/{_ID}", "GET", "get_pipeline_version"),
    (rf"/pipelines/{_ID}/versions/{_ID}", "DELETE", "delete_pipeline_version"),
    (r"/runs", "GET", "list_runs"),
    (r"/runs", "POST", "create_run"),
    (rf"/runs/{_ID}", "GET", "get_run"),
    (rf"/runs/{_ID}", "DELETE", "delete_run"),
    (rf"/runs/{_ID}:archive", "POST", "archive_run"),
    (rf"/runs/{_ID}:unarchive", "POST", "unarchive_run"),
    (rf"/runs/{_ID}:terminate", "POST", "terminate_run"),
    (r"/recurringruns", "GET", "list_recurring_runs"),
    (r"/recurringruns", "POST", "create_recurring_run"),
    (rf"/recurringruns/{_ID}", "GET", "get_recurring_run"),
    (rf"/recurringruns/{_ID}", "DELETE", "delete_recurring_run"),
    (rf"/recurringruns/{_ID}:enable", "POST", "enable_recurring_run"),
    (rf"/recurringruns/{_ID}:disable", "POST", "disable_recurring_run"),
]
"""(path regex without ``/apis/v2beta1``, method, KfpEmulator method): the v2beta1 routes."""


def _handler(kfp: KfpEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            call = {
                "method": method,
                "path": url.path,
                "query": query,
                "auth": self.headers.get("Authorization"),
                "body": None,
                "files": {},
            }
            kfp.calls.append(call)
            try:
                if kfp.token is not None and call["auth"] != f"Bearer {kfp.token}":
                    raise ApiError(UNAUTHENTICATED, "no valid bearer token (Authorization header)")
                content_type = self.headers.get("Content-Type", "")
                if content_type.startswith("multipart/form-data"):
                    message = BytesParser(policy=policy.default).parsebytes(
                        f"Content-Type: {content_type}\r\n\r\n".encode() + raw
                    )
                    for part in message.iter_parts():
                        name = part.get_param("name", header="content-disposition")
                        call["files"][name] = part.get_payload(decode=True)
                elif raw:
                    try:
                        call["body"] = json.loads(raw)
                    except ValueError as exc:
                        raise ApiError(INVALID_ARGUMENT, f"request body: not JSON: {exc}") from None
                if not url.path.startswith(API + "/"):
                    raise ApiError(NOT_FOUND, f"Not Found: {method} {url.path}")
                path = url.path.removeprefix(API)
                response = kfp.handle(method, path, query, call["body"], call["files"])
            except ApiError as exc:
                call["error"] = exc.message
                status = HTTP_STATUS.get(exc.code, 400)
                error = {"error": exc.message, "code": exc.code, "message": exc.message}
                return self._reply(status, {**error, "details": []})
            self._reply(200, response)

        def do_GET(self) -> None:  # noqa: N802
            self._handle("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._handle("POST")

        def do_DELETE(self) -> None:  # noqa: N802
            self._handle("DELETE")

    return Handler


@contextmanager
def kfp_emulator(
    run_states: list[dict] | tuple[dict, ...] = DEFAULT_RUN_STATES,
    on_run_done: Callable[[dict], None] | None = None,
    port: int = 0,
    token: str | None = None,
) -> Iterator[KfpEmulator]:
    """A started emulator on 127.0.0.1 (``.endpoint``), stopped on exit."""
    kfp = KfpEmulator(run_states, on_run_done, token=token).start(port=port)
    try:
        yield kfp
    finally:
        kfp.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.kfp_emulator --port N``: serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8888)
    parser.add_argument(
        "--states",
        default="RUNNING,SUCCEEDED",
        help="the states a run reports poll by poll, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--error", default="", help="the error message of a FAILED run")
    parser.add_argument("--token", help="require this bearer token on every call")
    args = parser.parse_args(argv)
    states = []
    for state in args.states.split(","):
        step = {"state": state.strip().upper()}
        if step["state"] == "FAILED" and args.error:
            step["error"] = {"code": 2, "message": args.error}
        try:
            check_model(step, "V2beta1Run", "--states")
        except ApiError as exc:
            parser.error(exc.message)
        states.append(step)
    kfp = KfpEmulator(states, token=args.token).start(args.host, args.port)
    print(f"KFP v2beta1 emulator on {kfp.endpoint} (Ctrl-C to stop)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        kfp.stop()


if __name__ == "__main__":
    main()
