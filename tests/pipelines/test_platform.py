"""Cluster settings compile into a strict KFP pipeline spec and Kubernetes platform spec."""

import secrets
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp import compiler, dsl
from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s_pb2
from kfp.pipeline_spec import pipeline_spec_pb2
from pydantic import ValidationError

from pipelines.platform import (
    PLATFORM_PRESETS,
    ClusterSettings,
    StepResources,
    apply_platform,
    get_platform,
    job_defaults,
    with_platform,
)

# lightweight components named like the real ones, so task and executor names match ours
IMAGE = "python:3.11"


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def data_prep(source: str) -> str:
    return source


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def base_model(source: str) -> str:
    return source


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def sft(data: str, model: str) -> str:
    return data + model


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def grpo(data: str, model: str) -> str:
    return data + model


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def evaluate(model: str) -> str:
    return model


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def register(model: str) -> str:
    return model


def _compile(settings: ClusterSettings | None, path: Path) -> list[dict]:
    platform = with_platform(settings) if settings else (lambda task, step: task)

    @dsl.pipeline(name="platform-test")
    def pipeline(source: str = "bundled"):
        prep = platform(data_prep(source=source), "data-prep")
        base = platform(base_model(source="tiny"), "base-model")
        tuned = platform(sft(data=prep.output, model=base.output), "sft")
        policy = platform(grpo(data=prep.output, model=tuned.output), "grpo")
        result = platform(evaluate(model=policy.output), "evaluate")
        with dsl.If(result.output == "promote"):
            platform(register(model=policy.output), "register")

    compiler.Compiler().compile(pipeline, str(path))
    return list(yaml.safe_load_all(path.read_text()))


def _parse(
    docs: list[dict],
) -> tuple[pipeline_spec_pb2.PipelineSpec, dict[str, k8s_pb2.KubernetesExecutorConfig]]:
    assert len(docs) == 2, "expected a pipeline spec and a platform spec"
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(docs[0], spec, ignore_unknown_fields=False)
    platform = pipeline_spec_pb2.PlatformSpec()
    json_format.ParseDict(docs[1], platform, ignore_unknown_fields=False)
    executors = platform.platforms["kubernetes"].deployment_spec.executors
    configs = {}
    for name, struct in executors.items():
        config = k8s_pb2.KubernetesExecutorConfig()
        json_format.ParseDict(
            json_format.MessageToDict(struct), config, ignore_unknown_fields=False
        )
        configs[name.removeprefix("exec-")] = config
    return spec, configs


def _all_tasks(
    spec: pipeline_spec_pb2.PipelineSpec,
) -> dict[str, pipeline_spec_pb2.PipelineTaskSpec]:
    tasks = dict(spec.root.dag.tasks)
    for component in spec.components.values():
        tasks.update(component.dag.tasks)
    return tasks


STEPS = ("data-prep", "base-model", "sft", "grpo", "evaluate", "register")
# the reference platforms train as PyTorchJobs: the sft/grpo pods only orchestrate, on CPU
GPU = {"evaluate"}
NETWORK = {"data-prep", "base-model", "evaluate", "register"}


def test_g5_settings_compile_to_a_strict_platform_spec(tmp_path):
    spec, configs = _parse(_compile(get_platform("g5.12xlarge"), tmp_path / "p.yaml"))
    assert set(configs) == set(STEPS)
    for step, config in configs.items():
        assert [(m.constant, m.mount_path) for m in config.pvc_mount] == [
            ("lingo-workspace", "/mnt/shared")
        ]
        envs = {
            (s.secret_name_parameter.runtime_value.constant.string_value, m.secret_key, m.env_var)
            for s in config.secret_as_env
            for m in s.key_to_env
        }
        assert ("lingo-s3", "AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY") in envs
        assert ("lingo-s3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL") in envs
        assert ("lingo-mlflow", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_TOKEN") in envs
        # every platform Secret is optional: a run that uses no S3, MLflow or gated model
        # starts without them (a required one that is missing keeps the pod from starting)
        assert all(s.optional for s in config.secret_as_env), step
        has_hf = ("lingo-hf", "HF_TOKEN", "HF_TOKEN") in envs
        assert has_hf == (step in {"data-prep", "base-model", "evaluate"}), step
        if step in GPU:
            assert dict(config.node_selector.labels) == {
                "nvidia.com/gpu.product": "NVIDIA-A10G",
                "node.kubernetes.io/instance-type": "g5.12xlarge",
            }
            assert [(t.key, t.operator, t.effect) for t in config.tolerations] == [
                ("nvidia.com/gpu", "Exists", "NoSchedule")
            ]
        else:
            assert not config.node_selector.labels, step
            assert not config.tolerations, step

    resources = {
        name.removeprefix("exec-"): executor.container.resources
        for name, executor in _executors(spec).items()
    }
    for step in STEPS:
        accelerator = resources[step].accelerator
        if step in GPU:
            assert (accelerator.resource_type, accelerator.resource_count) == (
                "nvidia.com/gpu",
                "4",
            )
            assert resources[step].resource_memory_limit == "180Gi"
        else:
            assert not accelerator.resource_type, step
            assert resources[step].resource_cpu_limit == "8"

    tasks = _all_tasks(spec)
    # issue 41: data prep's source can change under the same name (a cached data prep would
    # hand a run the old data)
    for step in ("data-prep", "sft", "grpo", "evaluate", "register", "base-model"):
        assert not tasks[step].caching_options.enable_cache, step
    for step in STEPS:
        retries = tasks[step].retry_policy.max_retry_count
        assert retries == (3 if step in NETWORK else 0), step


def _executors(spec: pipeline_spec_pb2.PipelineSpec) -> dict:
    deployment = pipeline_spec_pb2.PipelineDeploymentConfig()
    json_format.ParseDict(
        json_format.MessageToDict(spec.deployment_spec), deployment, ignore_unknown_fields=False
    )
    return dict(deployment.executors)


@pytest.mark.parametrize(
    ("node_type", "gpu"),
    [("p5en.48xlarge", "NVIDIA-H200"), ("p5.48xlarge", "NVIDIA-H100-80GB-HBM3")],
)
def test_p5_gpu_steps_take_eight_gpus_of_their_kind(tmp_path, node_type, gpu):
    spec, configs = _parse(_compile(get_platform(node_type), tmp_path / "p.yaml"))
    accelerator = _executors(spec)["exec-evaluate"].container.resources.accelerator
    assert (accelerator.resource_type, accelerator.resource_count) == ("nvidia.com/gpu", "8")
    labels = configs["evaluate"].node_selector.labels
    assert labels["nvidia.com/gpu.product"] == gpu
    assert labels["node.kubernetes.io/instance-type"] == node_type


def test_training_in_the_step_pod_takes_the_gpus(tmp_path):
    in_pod = get_platform("g5.12xlarge").model_copy(update={"training_jobs": False})
    spec, configs = _parse(_compile(in_pod, tmp_path / "p.yaml"))
    accelerator = _executors(spec)["exec-grpo"].container.resources.accelerator
    assert (accelerator.resource_type, accelerator.resource_count) == ("nvidia.com/gpu", "4")
    assert configs["sft"].node_selector.labels["nvidia.com/gpu.product"] == "NVIDIA-A10G"


def test_job_defaults_share_the_workspace_and_the_secrets_by_name():
    job = job_defaults(get_platform("g5.12xlarge"), "grpo")
    assert (job["shared_pvc"], job["shared_mount"]) == ("lingo-workspace", "/mnt/shared")
    assert {
        "name": "MLFLOW_TRACKING_TOKEN",
        "secret": "lingo-mlflow",
        "key": "MLFLOW_TRACKING_TOKEN",
        "optional": True,  # a run that tracks to no MLflow server needs no Secret
    } in job["secret_env"]
    assert all(item["secret"] != "lingo-hf" for item in job["secret_env"])  # not a GRPO secret
    assert job_defaults(get_platform("local"), "grpo") == {}


def test_local_settings_apply_nothing(tmp_path):
    local = _compile(PLATFORM_PRESETS["local"], tmp_path / "local.yaml")
    bare = _compile(None, tmp_path / "bare.yaml")
    assert len(local) == 1, "the local preset must not produce a platform spec"
    assert local == bare


def test_secret_values_from_the_environment_never_reach_the_yaml(tmp_path, monkeypatch):
    values = {
        name: secrets.token_urlsafe(24)
        for name in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL",
            "MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_TOKEN",
            "HF_TOKEN",
        )
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "p.yaml"
    _compile(get_platform("g5.12xlarge"), path)
    text = path.read_text()
    assert "lingo-s3" in text and "HF_TOKEN" in text  # the names are there …
    for name, value in values.items():
        assert value not in text, f"the value of ${name} leaked into the compiled YAML"


def test_unknown_steps_are_refused():
    with pytest.raises(ValueError, match="unknown step 'train'"):
        apply_platform(None, "train", PLATFORM_PRESETS["local"])  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="gpu_steps names unknown steps"):
        ClusterSettings(name="bad", gpu_steps=("train",))
    with pytest.raises(KeyError, match="g5.12xlarge"):
        get_platform("g5")


def test_accelerator_type_and_count_go_together():
    with pytest.raises(ValidationError, match="go together"):
        StepResources(accelerator_type="nvidia.com/gpu")
    with pytest.raises(ValidationError, match="go together"):
        StepResources(accelerator_count=4)


@pytest.mark.parametrize("preset", ["tiny-cpu", "gpt-oss-20b"])
def test_the_compiled_pipeline_retrains_only_on_new_data_and_publishes_only_on_promote(preset):
    """Issue 41, read from the compiled spec: data prep, the data check and the champion are
    never served from cache; everything after the data check runs under ``retrain``; publish
    runs only under the gate's ``promote``."""
    from pipelines.compile import compiled_path

    docs = list(yaml.safe_load_all(compiled_path(preset).read_text()))
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(docs[0], spec, ignore_unknown_fields=False)
    tasks = _all_tasks(spec)
    for step in ("data-prep", "data-check", "champion"):
        assert not tasks[step].caching_options.enable_cache, step
    owner = {  # task name → the component whose DAG holds it
        name: component
        for component, spec_component in spec.components.items()
        for name in spec_component.dag.tasks
    }
    conditions = {
        name: task.trigger_policy.condition
        for name, task in tasks.items()
        if task.trigger_policy.condition
    }
    new_data = next(n for n, c in conditions.items() if "data-check-Output" in c)
    assert conditions[new_data].endswith("== 'retrain'")
    assert owner["base-model"] == tasks[new_data].component_ref.name
    beats = next(n for n, c in conditions.items() if "gate-Output" in c)
    assert conditions[beats].endswith("== 'promote'")
    assert owner["register"] == tasks[beats].component_ref.name
    export = owner["publish"]  # the export_uri condition, itself inside beats-champion
    assert owner[next(n for n, t in tasks.items() if t.component_ref.name == export)] == (
        tasks[beats].component_ref.name
    )


def test_every_gpu_node_type_has_its_platform_and_its_training_job():
    """A node type in ``cluster.nodes.NODE_TYPES`` is usable whole: a preset's
    ``hardware.node_type`` picks its pipeline platform (GPU steps' selector) and its
    training job's reference layout (the TrainJob's pods), each on that instance type."""
    from cluster.config import REFERENCE_LAYOUTS
    from cluster.nodes import NODE_TYPES

    gpu_nodes = {name for name, node in NODE_TYPES.items() if node.device == "cuda"}
    assert gpu_nodes == set(PLATFORM_PRESETS) - {"local"} == set(REFERENCE_LAYOUTS)
    for name in gpu_nodes:
        selector = REFERENCE_LAYOUTS[name]["node_selector"]
        assert selector == {"node.kubernetes.io/instance-type": name}
        assert REFERENCE_LAYOUTS[name]["gpus_per_node"] == NODE_TYPES[name].gpus
