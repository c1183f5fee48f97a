"""The PyTorchJob manifest for the reference layouts: structure, SDK round trip, no secrets."""

from __future__ import annotations

import json

import pytest
import yaml
from kubeflow.training import ApiClient as KubeflowApiClient
from pydantic import ValidationError

from cluster.pytorchjob import (
    ClusterJobConfig,
    ElasticSettings,
    SecretEnv,
    build_pytorchjob,
    manifest_yaml,
    reference_layout,
)

IMAGE = "quay.io/example/lingo-rl:1.0"
ARGS = ["--config", "/mnt/shared/run/sft.json", "--base-model", "/mnt/shared/models/base"]


def _manifest(instance_type: str, **overrides) -> dict:
    cluster = reference_layout(
        instance_type,
        IMAGE,
        namespace="team",
        env={"MLFLOW_TRACKING_URI": "http://mlflow:5000"},
        secret_env_from=["s3-credentials"],
        secret_env=[SecretEnv(name="HF_TOKEN", secret="hf", key="token")],
        **overrides,
    )
    return build_pytorchjob("sft-run", cluster, "trainer.sft", ARGS)


@pytest.mark.parametrize(
    ("instance_type", "workers", "gpus", "cpu", "memory", "shm"),
    [
        ("g5.12xlarge", 3, 4, "44", "160Gi", "32Gi"),
        ("p5en.48xlarge", 1, 8, "180", "1800Gi", "256Gi"),
    ],
)
def test_reference_layout_manifest_structure(instance_type, workers, gpus, cpu, memory, shm):
    job = _manifest(instance_type)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"] == {"name": "sft-run", "namespace": "team"}
    spec = job["spec"]
    assert spec["nprocPerNode"] == str(gpus)
    assert "elasticPolicy" not in spec
    assert spec["runPolicy"] == {"backoffLimit": 0, "cleanPodPolicy": "None"}
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] == workers
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never"
        template = replica["template"]
        assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
        pod = template["spec"]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": instance_type}
        assert pod["tolerations"] == [
            {"effect": "NoSchedule", "key": "nvidia.com/gpu", "operator": "Exists"}
        ]
        assert pod["volumes"] == [
            {"name": "shared", "persistentVolumeClaim": {"claimName": "lingo-rl-shared"}},
            {
                "name": "dshm",
                "emptyDir": {
                    "medium": "Memory",
                    "sizeLimit": shm,
                },
            },
        ]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        assert container["image"] == IMAGE
        assert container["command"] == [
            "python", "-m", "torch.distributed.run", "-m", "trainer.sft", *ARGS
        ]  # fmt: skip
        assert container["resources"] == {
            "requests": {"cpu": cpu, "memory": memory},
            "limits": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus)},
        }
        assert container["volumeMounts"] == [
            {"name": "shared", "mountPath": "/mnt/shared"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ]
        assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
        assert container["env"] == [
            {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"},
            # the pod's CPUs shared by its ranks (torchrun would give each one thread)
            {"name": "OMP_NUM_THREADS", "value": str(int(cpu) // gpus)},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ]


def test_g5_layout_trains_on_sixteen_gpus():
    cluster = reference_layout("g5.12xlarge", IMAGE)
    assert (cluster.nodes, cluster.procs_per_node, cluster.world_size) == (4, 4, 16)


def test_manifest_round_trips_through_the_sdk_models():
    job = _manifest("g5.12xlarge", elastic=ElasticSettings(min_nodes=2, max_nodes=4))

    class Response:  # what the SDK's deserialize reads: the body as JSON text
        data = json.dumps(job)

    sdk = KubeflowApiClient()
    model = sdk.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    assert model.spec.nproc_per_node == "4"
    assert model.spec.elastic_policy.rdzv_backend == "c10d"
    assert model.spec.elastic_policy.max_replicas == 4
    master = model.spec.pytorch_replica_specs["Master"].template.spec
    assert master.containers[0].resources.limits["nvidia.com/gpu"] == "4"
    assert master.volumes[1].empty_dir.medium == "Memory"
    assert sdk.sanitize_for_serialization(model) == job
    assert yaml.safe_load(manifest_yaml(job)) == job


def test_single_node_job_has_no_workers():
    cluster = ClusterJobConfig(image=IMAGE, nodes=1)
    spec = build_pytorchjob("tiny", cluster, "trainer.grpo", [])["spec"]
    assert list(spec["pytorchReplicaSpecs"]) == ["Master"]
    assert spec["nprocPerNode"] == "1"
    container = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_no_secret_values_reach_the_manifest():
    text = manifest_yaml(_manifest("p5en.48xlarge"))
    assert "secretKeyRef" in text and "s3-credentials" in text
    container = yaml.safe_load(text)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"
    ][0]
    (hf_token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert "value" not in hf_token


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "DB_PASSWORD"])
def test_plain_env_rejects_credentials(name):
    with pytest.raises(ValidationError, match=name):
        ClusterJobConfig(image=IMAGE, env={name: "s3cr3t"})


def test_elastic_range_must_cover_nodes():
    with pytest.raises(ValidationError, match="outside elastic"):
        reference_layout("g5.12xlarge", IMAGE, elastic=ElasticSettings(min_nodes=1, max_nodes=2))


def test_unknown_layout_names_the_known_ones():
    with pytest.raises(KeyError, match="g5.12xlarge"):
        reference_layout("trn1.32xlarge", IMAGE)


def test_a_variable_set_plain_and_from_a_secret_is_listed_once_from_the_secret():
    """The step passes its MLflow settings as plain env and the platform the same variable
    from the ``lingo-mlflow`` Secret: the container lists it once (an API server refuses a
    container env naming a variable twice: 422 "Duplicate value"), from the Secret."""
    uri = SecretEnv(name="MLFLOW_TRACKING_URI", secret="lingo-mlflow", key="MLFLOW_TRACKING_URI")
    cluster = reference_layout(
        "g5.12xlarge",
        IMAGE,
        env={"MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_EXPERIMENT_NAME": "lingo-rl"},
        secret_env=[uri],
    )
    master = build_pytorchjob("sft-run", cluster, "trainer.sft", ARGS)["spec"][
        "pytorchReplicaSpecs"
    ]["Master"]["template"]["spec"]
    assert master["containers"][0]["env"] == [
        {"name": "MLFLOW_EXPERIMENT_NAME", "value": "lingo-rl"},
        {"name": "OMP_NUM_THREADS", "value": "11"},  # 44 CPUs, 4 ranks
        {
            "name": "MLFLOW_TRACKING_URI",
            "valueFrom": {"secretKeyRef": {"name": "lingo-mlflow", "key": "MLFLOW_TRACKING_URI"}},
        },
    ]


def test_one_variable_from_two_secrets_is_refused():
    twice = [SecretEnv(name="HF_TOKEN", secret=s, key="token") for s in ("hf", "hf-backup")]
    with pytest.raises(ValidationError, match=r"secret_env sets \['HF_TOKEN'\] from several"):
        ClusterJobConfig(image=IMAGE, secret_env=twice)
