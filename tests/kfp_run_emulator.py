"""The KFP emulator (tests/kfp_emulator.py) with runs that have tasks and output artifacts.

An emulator, not a KFP server: none can run here (it needs Kubernetes, MySQL, Argo and
ML Metadata). What it adds to ``KfpEmulator`` is what a finished run exposes on a real server:

- ``GET /runs/{id}`` carries ``run_details.task_details``: the tasks of the uploaded pipeline
  spec (walked from its root DAG; of a ``dsl.If/Elif`` group only the first branch runs),
  poll by poll one more SUCCEEDED and the next RUNNING while the run is RUNNING, all SUCCEEDED
  with their ``outputs`` (artifact ids) once it SUCCEEDED. The shape is checked against
  ``kfp_server_api``'s ``V2beta1RunDetails``.
- ``GET /artifacts/{id}`` (the v2beta1 ArtifactService, ``artifacts.proto``): ``artifact_id``,
  ``uri``, ``storage_provider``, ``storage_path``, ``artifact_type``, ``artifact_size``.
- When the run SUCCEEDS, the outputs given to the emulator (local files or directories standing
  in for what the steps wrote) are uploaded to a real S3-compatible server (moto) at the URIs
  the KFP launcher uses: ``<pipeline root>/<pipeline name>/<run id>/<task>/<output>``; a file
  is one object at that key, a directory one object per file under it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kfp_emulator import NOT_FOUND, TERMINAL_STATES, ApiError, KfpEmulator, check_model, now


def spec_tasks(spec: dict) -> list[str]:
    """The names of the tasks a run of pipeline spec ``spec`` runs, DAG order as listed,
    groups (exit handler, conditions) before the tasks inside them."""
    components = spec.get("components") or {}
    names: list[str] = []

    def walk(dag: dict, first_branch_only: bool = False) -> None:
        tasks = list((dag.get("tasks") or {}).items())
        if first_branch_only:
            tasks = tasks[:1]
        for name, task in tasks:
            names.append(name)
            component = components.get(task["componentRef"]["name"]) or {}
            if "dag" in component:
                walk(component["dag"], name.startswith("condition-branches-"))

    walk(spec["root"]["dag"])
    for name, task in (spec["root"]["dag"].get("tasks") or {}).items():
        if task.get("triggerPolicy", {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED":
            names.remove(name)
            names.append(name)  # the exit task runs last
    return names


class RunOutputsEmulator(KfpEmulator):
    """``KfpEmulator`` whose runs list their tasks and store their outputs in S3.

    Args:
        s3: a boto3 S3 client of the object store standing in for the pipeline root's.
        bucket: the pipeline root's bucket (created here if missing).
        outputs: ``{(task, output): local path}``; what the run's tasks "wrote".
        run_states: as ``KfpEmulator``'s.
        failed_task: the task shown FAILED (with ``failed_message``) when a run FAILS; the
            tasks after it do not start.
        list_outputs: whether tasks list their output artifact ids (a KFP 2.x server may
            leave ``outputs`` empty; the objects are stored either way).
    """

    def __init__(
        self,
        s3,
        bucket: str,
        outputs: dict[tuple[str, str], Path],
        run_states: list[dict] | tuple[dict, ...],
        failed_task: str | None = None,
        failed_message: str = "",
        list_outputs: bool = True,
    ) -> None:
        super().__init__(run_states)
        self.list_outputs = list_outputs
        self.failed_task, self.failed_message = failed_task, failed_message
        self.s3, self.bucket, self.outputs = s3, bucket, outputs
        self.artifacts: dict[str, dict] = {}
        self._task_polls: dict[str, int] = {}
        self._artifact_ids = iter(range(101, 10_000))
        self._task_artifacts: dict[str, dict[str, dict[str, list[str]]]] = {}
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)

    def handle(self, method: str, path: str, query: dict, body: Any, files: dict) -> dict:
        if method == "GET" and path.startswith("/artifacts/"):
            artifact_id = path.removeprefix("/artifacts/")
            with self._lock:
                if artifact_id not in self.artifacts:
                    raise ApiError(NOT_FOUND, f"artifact {artifact_id} not found")
                return copy.deepcopy(self.artifacts[artifact_id])
        return super().handle(method, path, query, body, files)

    def get_run(self, run_id: str, **kwargs: Any) -> dict:
        run = super().get_run(run_id, **kwargs)
        polls = self._task_polls.get(run_id, 0)
        self._task_polls[run_id] = polls + 1
        spec = self.specs[run["pipeline_version_reference"]["pipeline_version_id"]]
        names = spec_tasks(spec)
        if run["state"] == "SUCCEEDED" and run_id not in self._task_artifacts:
            self._task_artifacts[run_id] = self._store_outputs(run_id, spec, names)
        details = []
        failed_at = names.index(self.failed_task) if self.failed_task else len(names)
        for index, name in enumerate(names):
            if run["state"] == "FAILED" and index >= failed_at:
                if index > failed_at:
                    continue
                state = "FAILED"
            elif run["state"] in ("SUCCEEDED", "FAILED") or index < polls:
                state = "SUCCEEDED"
            elif index == polls and run["state"] not in TERMINAL_STATES:
                state = "RUNNING"
            else:
                continue  # not started yet
            task = {
                "run_id": run_id,
                "task_id": f"{run_id}-task-{index:02d}",
                "display_name": name,
                "create_time": run["created_at"],
                "start_time": run["created_at"],
                "state": state,
                "pod_name": f"{name}-{index:04d}",
            }
            if state in TERMINAL_STATES:
                task["end_time"] = now()
            if state == "FAILED":
                task["error"] = {"code": 2, "message": self.failed_message}
            outputs = self._task_artifacts.get(run_id, {}).get(name)
            if outputs and self.list_outputs:
                task["outputs"] = {k: {"artifact_ids": v} for k, v in outputs.items()}
            details.append(task)
        run["run_details"] = check_model({"task_details": details}, "V2beta1RunDetails")
        return run

    def _store_outputs(self, run_id: str, spec: dict, names: list[str]) -> dict:
        """Upload the outputs of the tasks the run ran; their artifact ids by task and output."""
        pipeline = spec["pipelineInfo"]["name"]
        by_task: dict[str, dict[str, list[str]]] = {}
        for (task, output), local in self.outputs.items():
            if task not in names:
                raise AssertionError(f"emulator: task {task!r} is not in the run ({names})")
            key = f"{pipeline}/{run_id}/{task}/{output}"
            files = (
                [(key, local)]
                if local.is_file()
                else [(f"{key}/{p.relative_to(local).as_posix()}", p) for p in local.rglob("*")]
            )
            size = 0
            for object_key, path in files:
                if path.is_file():
                    self.s3.put_object(Bucket=self.bucket, Key=object_key, Body=path.read_bytes())
                    size += path.stat().st_size
            artifact_id = str(next(self._artifact_ids))
            self.artifacts[artifact_id] = {
                "artifact_id": artifact_id,
                "storage_provider": "s3",
                "storage_path": key,
                "uri": f"s3://{self.bucket}/{key}",
                "namespace": "lingo",
                "artifact_type": "system.Artifact",
                "artifact_size": str(size),
                "created_at": now(),
                "last_updated_at": now(),
            }
            by_task.setdefault(task, {})[output] = [artifact_id]
        return by_task
