"""The job APIs a training step runs on, looked up by ``cluster.job_api``: each one
``cluster.jobs.JobKind`` (its custom resource, its manifest builder, its runtimes).

The specs live in ``cluster`` because ``cluster`` reads them itself, below the plan: the
launcher follows a job by its kind's conditions and labels, the step job builds the manifest
with the kind's builder, and ``job_api: auto`` asks the API server which of ``JOB_KINDS`` it
serves. The layers above read the same objects here (``job_spec(name).build``,
``.cluster_runtime_plural``) instead of comparing names; a new job API is one module that
builds its ``JobKind`` and one entry in ``cluster.jobs.JOB_KINDS``.
"""

from __future__ import annotations

from cluster.jobs import JOB_KINDS, JobKind
from plan.specs import lookup

JobSpec = JobKind
"""The plan's name for a job API's spec (``TrainerSpec``, ``EngineSpec``, ``JobSpec``)."""


def job_spec(name: str, field: str = "cluster.job_api") -> JobSpec:
    """The spec of the job API ``name`` (not ``auto``: which one that is, only the API
    server's discovery says, ``cluster.jobs.resolve_job_api``).

    Raises:
        UnknownSpecError: no job API of that name; the message names ``field`` and the known
            names.
    """
    return lookup(JOB_KINDS, name, field, "job API")
