"""Every manifest lingo-rl can send to a cluster is one the API server accepts.

For every preset, both training steps and both job APIs, the job ``run_step_job`` creates is
built as in the step's pod (the MLflow settings in its environment, as the ``lingo-mlflow``
Secret puts them there) and checked against the real CRDs (``tests/cluster/crds``, upstream
copies) by ``crd_rules.api_server_errors``: the served version's schema with a JSON-schema
validator, the list-type rules, the CEL rules, the object's metadata; TrainJobs also against
the Trainer webhook's rules and the ClusterTrainingRuntime we ship, which is checked too. No
API server can run here: these are its rules, applied by the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from crd_rules import api_server_errors, cel_rules, served_schema, trainer_webhook_errors

from cluster.config import PROGRESS_PORT_ENV
from cluster.jobs import PYTORCHJOB, TRAINJOB, JobKind
from cluster.pytorchjob import build_pytorchjob, manifest_yaml
from cluster.step_job import StepJob, build_step_manifest, job_name, step_cluster
from cluster.trainjob import build_trainjob
from components.images import GPU_IMAGE
from pipelines.overrides import apply_overrides
from pipelines.presets import PRESETS, Preset, step_execution, training_runtime

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED_RUNTIME = ROOT / "deploy" / "cluster-training-runtime.yaml"
RUN_ID = "3f1c2a9e-5b7d-4e0f-9a31-0c6f2d8e4b17"
CLUSTER_PRESETS = [name for name, p in PRESETS.items() if not p.hardware.local]
KINDS = {TRAINJOB.api: TRAINJOB, PYTORCHJOB.api: PYTORCHJOB}
STEP_INPUTS = {"sft": "base-model", "grpo": "sft-model"}


@pytest.fixture
def step_pod_env(monkeypatch):
    """The environment of a training step's pod: MLflow settings from the ``lingo-mlflow``
    Secret and the pipeline (the job gets them as env, ``step_cluster``)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team.svc:5000")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lingo-rl")
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", "0a1b2c3d4e5f")


def step_manifest(preset: Preset, step: str, kind: JobKind) -> dict:
    """The job ``run_step_job`` creates for ``step`` of ``preset`` (its arguments as
    ``stage_inputs`` writes them)."""
    execution = step_execution(preset, step)
    cluster = step_cluster(execution, GPU_IMAGE, "team")
    shared = f"{execution.shared_dir(cluster)}/{job_name(step, RUN_ID)}"
    config = getattr(preset, step)
    job = StepJob(step, f"trainer.{step}", config, STEP_INPUTS[step], "m", "t", "e")
    args = [
        "--config", f"{shared}/{step}_config.json",
        f"--{STEP_INPUTS[step]}", f"{shared}/inputs/{STEP_INPUTS[step]}",
        "--train", f"{shared}/inputs/train", "--eval", f"{shared}/inputs/eval",
        "--model-output", f"{shared}/model", "--work-dir", f"{shared}/work",
    ]  # fmt: skip
    return build_step_manifest(job, cluster, RUN_ID, args, kind)


def _container_env(manifest: dict) -> list[dict]:
    if manifest["kind"] == "TrainJob":
        return manifest["spec"]["trainer"]["env"]
    master = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return master["containers"][0]["env"]


@pytest.mark.parametrize("queue", [None, "team-a"], ids=["no-queue", "kueue"])
@pytest.mark.parametrize("api", list(KINDS))
@pytest.mark.parametrize("step", ["sft", "grpo"])
@pytest.mark.parametrize("preset_name", CLUSTER_PRESETS)
def test_every_job_the_project_creates_is_accepted(preset_name, step, api, queue, step_pod_env):
    preset = PRESETS[preset_name]
    if queue:
        preset = apply_overrides(preset, {"cluster.queue": queue})
    manifest = step_manifest(preset, step, KINDS[api])
    evaluated: list[str] = []
    assert api_server_errors(manifest, evaluated) == []
    env = {e["name"]: e for e in _container_env(manifest)}
    # the tracking URI comes once, from the Secret (it would be twice: 422 "Duplicate value")
    assert "secretKeyRef" in env["MLFLOW_TRACKING_URI"]["valueFrom"]
    assert env["MLFLOW_PARENT_RUN_ID"]["value"] == "0a1b2c3d4e5f"
    labels = manifest["metadata"]["labels"]
    assert labels.get("kueue.x-k8s.io/queue-name") == queue
    if api == TRAINJOB.api:
        assert trainer_webhook_errors(manifest, training_runtime(preset, GPU_IMAGE)) == []
        assert any("size(self.metadata.name)" in rule for rule in evaluated)
        annotations = manifest["metadata"]["annotations"]
        assert annotations["trainer.opendatahub.io/progression-tracking"] == "true"
        assert annotations["trainer.opendatahub.io/metrics-port"] == env[PROGRESS_PORT_ENV]["value"]


def test_presets_that_train_locally_create_no_job():
    assert CLUSTER_PRESETS, "no preset runs on a cluster: the test above checks nothing"
    for name, preset in PRESETS.items():
        if name not in CLUSTER_PRESETS:
            assert {step_execution(preset, s).mode for s in ("sft", "grpo")} == {"local"}


@pytest.mark.parametrize("preset_name", CLUSTER_PRESETS)
def test_the_shipped_runtime_is_accepted(preset_name):
    runtime = training_runtime(PRESETS[preset_name], GPU_IMAGE)
    evaluated: list[str] = []
    assert api_server_errors(runtime, evaluated) == []
    assert any("has(self.torch)" in rule for rule in evaluated)


def test_the_runtime_in_deploy_is_the_one_the_code_builds():
    runtime = training_runtime(PRESETS["gpt-oss-20b"], GPU_IMAGE)
    assert yaml.safe_load(DEPLOYED_RUNTIME.read_text()) == runtime, (
        "deploy/cluster-training-runtime.yaml is stale: run `lingo cluster install-runtime "
        "--dry-run > deploy/cluster-training-runtime.yaml` and commit it"
    )


# The CRDs' CEL rules, transition rules (reading oldSelf: updates only) left out. A new CRD
# version with other rules fails here until they are read and listed; the ones our manifests
# reach are evaluated on every manifest above (``cel_errors``).
CEL_RULES = {
    ("TrainJob", "trainer.kubeflow.org/v1alpha1"): {
        # our job names (job_name): lowercase, <= 52 characters
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "size(self.metadata.name) <= 63",
        # fields we never set (initializers, managedBy) or never send (status)
        "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')",
        "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']",
        "has(self.lastUpdatedTime)",
    },
    ("ClusterTrainingRuntime", "trainer.kubeflow.org/v1alpha1"): {
        # one ML policy (ours: torch)
        "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)]"
        ".filter(x, x).size() <= 1",
        "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
        "self.replicatedJobs.exists(x, has(x.dependsOn)))",
        # fields we never set (flux, envInjection, volumeClaimPolicies)
        "self >= 1",
        "!self.exists(c, c == 'node')",
        "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)",
    },
    ("PyTorchJob", "kubeflow.org/v1"): set(),
}


@pytest.mark.parametrize(("kind", "api_version"), list(CEL_RULES), ids=lambda k: str(k))
def test_the_cel_rules_are_the_ones_read(kind, api_version):
    rules = {rule for _, rule, _ in cel_rules(served_schema(kind, api_version))}
    assert {rule for rule in rules if "oldSelf" not in rule} == CEL_RULES[kind, api_version]


def _trainjob(**overrides) -> dict:
    from cluster.config import ClusterJobConfig

    cluster = ClusterJobConfig(image="img:1", namespace="team", **overrides)
    return build_trainjob("lingo-sft-run", cluster, "trainer.sft", ["--config", "c.json"])


def test_the_checks_catch_what_an_api_server_refuses():
    """Each check fails on what the server would refuse (so a pass above means something)."""
    from cluster.config import ClusterJobConfig

    pytorchjob = build_pytorchjob(
        "sft-run", ClusterJobConfig(image="img:1", env={"A": "1"}), "trainer.sft", []
    )
    container = pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"
    ][0]
    container["env"].append({"name": "A", "value": "2"})  # today's main: the tracking URI twice
    assert any("env: Duplicate value: {name='A'}" in e for e in api_server_errors(pytorchjob))
    long_name = {**_trainjob(), "metadata": {"name": "lingo-" + "x" * 60, "namespace": "t"}}
    assert any("no more than 63" in e for e in api_server_errors(long_name))
    upper = {**_trainjob(), "metadata": {"name": "Lingo-sft", "namespace": "t"}}
    assert any("RFC 1035" in e for e in api_server_errors(upper))
    unknown = _trainjob()
    unknown["spec"]["trainer"]["numGpus"] = 4
    assert any("'numGpus' was unexpected" in e for e in api_server_errors(unknown))
    bad_label = _trainjob()
    bad_label["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team a"}
    assert any("not a label value" in e for e in api_server_errors(bad_label))
    runtime = training_runtime(PRESETS["gpt-oss-20b"], "img:1")
    runtime["spec"]["mlPolicy"]["mpi"] = {}
    assert any("Only one of the policy" in e for e in api_server_errors(runtime))


def test_the_trainer_webhook_checks_catch_what_it_refuses():
    runtime = training_runtime(PRESETS["gpt-oss-20b"], "img:1")
    job = _trainjob(env={"PET_NNODES": "2"})
    job["spec"]["runtimePatches"][0]["manager"] = "lingo"
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]["template"]["spec"]["template"]["spec"]
    pod["containers"].append({"name": "sidecar"})
    pod["containers"][0]["env"] = [{"name": "X", "value": "1"}]
    errors = "\n".join(trainer_webhook_errors(job, runtime))
    for refused in ("reserved envs ['PET_NNODES']", "domain-prefixed", "no container 'sidecar'",
                    "envs for the node container"):  # fmt: skip
        assert refused in errors


def test_a_trainjob_refuses_what_only_a_pytorchjob_carries():
    from cluster.config import ElasticSettings

    with pytest.raises(ValueError, match="secret_env_from: a TrainJob cannot carry"):
        _trainjob(secret_env_from=["lingo-s3"])
    with pytest.raises(ValueError, match="cluster.job_api=pytorchjob"):
        _trainjob(nodes=2, elastic=ElasticSettings(min_nodes=1, max_nodes=2))


def test_progress_tracking_can_be_switched_off():
    job = _trainjob(progress_tracking=False)
    assert "annotations" not in job["metadata"]
    assert PROGRESS_PORT_ENV not in {e["name"] for e in job["spec"]["trainer"].get("env") or []}
    assert "progression" not in manifest_yaml(job)


def test_the_stock_runtime_upstream_ships_is_accepted():
    """The checks refuse nothing a real cluster runs (the Trainer's own torch-distributed
    runtime, copied unchanged from its v2.3.0 manifests)."""
    stock = yaml.safe_load(
        (ROOT / "tests/cluster/crds/v2.3.0_runtime_torch-distributed.yaml").read_text()
    )
    assert api_server_errors(stock) == []
