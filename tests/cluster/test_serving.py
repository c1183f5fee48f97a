"""The champion's KServe InferenceService (cluster/serving.py): accepted by the InferenceService
CRD's schema (tests/cluster/crds, a trimmed copy of KServe v0.20.0's), applied and replaced
through the real ``kubernetes`` client against kmock's emulator (no API server can run here),
and allowed by the Role ``lingo cluster setup`` creates."""

from __future__ import annotations

import copy

import pytest
from crd_rules import api_server_errors, served_schema
from kube_emulator import kube_emulator
from kubernetes import client as k8s

from cluster.access import DEPLOY_ACCESS, grants, job_role_rules
from cluster.serving import (
    GROUP,
    PLURAL,
    REASONING_PARSER,
    VERSION,
    NotReadyError,
    ServingConfig,
    apply_inference_service,
    inference_service,
    published_model_uri,
    wait_ready,
)
from pipelines.presets import PRESETS, serving_config

URI = published_model_uri("s3://models/lingo/run-7f3a/")


@pytest.mark.parametrize("preset_name", [n for n, p in PRESETS.items() if p.serving.enabled])
def test_each_preset_s_inference_service_is_accepted(preset_name):
    preset = PRESETS[preset_name]
    config = serving_config(preset)
    manifest = inference_service(config, URI, "team", {"lingo-rl/pipeline-run": "run-7f3a"})
    assert api_server_errors(manifest) == []
    model = manifest["spec"]["predictor"]["model"]
    assert model["storageUri"] == "s3://models/lingo/run-7f3a/grpo-model/"
    assert f"--reasoning-parser={REASONING_PARSER}" in model["args"]
    assert f"--tensor-parallel-size={config.gpus}" in model["args"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == str(config.gpus)
    # resources from the preset: the GRPO engines' TP where serving.gpus is not given
    expected = preset.serving.gpus or preset.grpo.rollout.tensor_parallel_size
    assert config.gpus == expected


def test_the_reasoning_parser_is_one_vllm_registers():
    """vLLM's own registry name (checked here against the source of vLLM 0.32's registry, as
    installed in the GPU image's version line; the CPU build's test env has the package)."""
    vllm = pytest.importorskip("vllm.reasoning")
    assert REASONING_PARSER in vllm.ReasoningParserManager.list_registered()


def test_canary_and_options_are_accepted_and_checked():
    config = ServingConfig(
        gpus=2,
        canary_traffic_percent=10,
        deployment_mode="Serverless",
        service_account="lingo-s3",
        min_replicas=0,
        max_replicas=3,
        max_model_len=None,
    )
    manifest = inference_service(config, URI, "team")
    assert api_server_errors(manifest) == []
    predictor = manifest["spec"]["predictor"]
    assert predictor["canaryTrafficPercent"] == 10
    assert predictor["serviceAccountName"] == "lingo-s3"
    assert manifest["metadata"]["annotations"] == {"serving.kserve.io/deploymentMode": "Serverless"}
    schema = served_schema("InferenceService", "serving.kserve.io/v1beta1")
    predictor_schema = schema["properties"]["spec"]["properties"]["predictor"]["properties"]
    assert predictor_schema["canaryTrafficPercent"]["type"] == "integer"


def test_the_schema_check_catches_what_the_api_server_refuses():
    manifest = inference_service(ServingConfig(gpus=1), URI, "team")
    wrong = copy.deepcopy(manifest)
    wrong["spec"]["predictor"]["model"]["modelFormat"] = {"version": "1"}  # name is required
    wrong["spec"]["predictor"]["minReplicas"] = "one"
    wrong["spec"]["predictor"]["model"]["storageURI"] = URI  # misspelt: pruned on a server
    errors = "\n".join(api_server_errors(wrong))
    assert "'name' is a required property" in errors
    assert "'one' is not of type 'integer'" in errors
    assert "storageURI" in errors


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "Lingo_Champion", "InferenceService name"),
        ("canary_traffic_percent", 120, "less than or equal to 100"),
        ("deployment_mode", "Knative", "Serverless"),
    ],
)
def test_bad_serving_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig(**{field: value})


def test_a_storage_uri_kserve_cannot_read_is_refused():
    with pytest.raises(ValueError, match="storage initializer reads"):
        inference_service(ServingConfig(gpus=1), "/shared/model", "team")


def test_the_setup_role_grants_the_deploy_step_what_it_needs():
    assert all(grants(job_role_rules(), need) for need in DEPLOY_ACCESS)
    assert {(a.verb, a.what) for a in DEPLOY_ACCESS} == {
        ("create", "inferenceservices.serving.kserve.io"),
        ("get", "inferenceservices.serving.kserve.io"),
        ("patch", "inferenceservices.serving.kserve.io"),
    }


def test_apply_creates_then_replaces_and_waits_for_ready():
    with kube_emulator(apis=("kserve",)) as api_client:
        first = inference_service(ServingConfig(gpus=1), URI, "team", {"run": "a"})
        assert apply_inference_service(api_client, first) == "created"
        api = k8s.CustomObjectsApi(api_client)
        stored = api.get_namespaced_custom_object(GROUP, VERSION, "team", PLURAL, "lingo-gpt-oss")
        assert stored["spec"] == first["spec"]

        second_uri = published_model_uri("s3://models/lingo/run-8b1c")
        second = inference_service(
            ServingConfig(gpus=1, canary_traffic_percent=10), second_uri, "team", {"run": "b"}
        )
        assert apply_inference_service(api_client, second) == "replaced"
        stored = api.get_namespaced_custom_object(GROUP, VERSION, "team", PLURAL, "lingo-gpt-oss")
        assert stored["spec"]["predictor"]["model"]["storageUri"] == second_uri
        assert stored["spec"]["predictor"]["canaryTrafficPercent"] == 10
        assert stored["metadata"]["labels"]["run"] == "b"

        third = inference_service(ServingConfig(gpus=1), second_uri, "team", {"run": "c"})
        apply_inference_service(api_client, third)  # no canary now: the field goes
        stored = api.get_namespaced_custom_object(GROUP, VERSION, "team", PLURAL, "lingo-gpt-oss")
        assert "canaryTrafficPercent" not in stored["spec"]["predictor"]
        assert stored["spec"] == third["spec"]

        with pytest.raises(NotReadyError, match="not Ready after 0 s: no Ready condition yet"):
            wait_ready(api_client, "team", "lingo-gpt-oss", timeout_s=0, sleep=lambda s: None)
        ready = {
            "url": "https://lingo-gpt-oss-team.apps.example.com",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, "team", PLURAL, "lingo-gpt-oss", {"status": ready}
        )
        url = wait_ready(api_client, "team", "lingo-gpt-oss", timeout_s=5, poll_s=0)
        assert url == "https://lingo-gpt-oss-team.apps.example.com"


def _tasks_calling(components: dict, name: str):
    for owner, component in components.items():
        for task_name, task in (component.get("dag") or {}).get("tasks", {}).items():
            if task.get("componentRef", {}).get("name") == name:
                yield owner, task_name, task


@pytest.mark.parametrize("preset_name", ["gpt-oss-20b", "gpt-oss-20b-verl", "tiny-cpu"])
def test_deploy_runs_only_on_promote_after_publish(preset_name):
    """In the kept compiled pipeline (the drift test keeps it equal to what the code
    compiles): ``deploy`` takes publish's prefix, inside ``export_uri != ''`` inside the
    gate's ``promote``; presets without ``serving.enabled`` have none."""
    import yaml

    from pipelines.compile import compiled_path

    spec = next(yaml.safe_load_all(compiled_path(preset_name).read_text()))
    components = {**spec["components"], "root": spec["root"]}
    owners = [
        (owner, task)
        for owner, component in components.items()
        for name, task in (component.get("dag") or {}).get("tasks", {}).items()
        if name == "deploy"
    ]
    if not PRESETS[preset_name].serving.enabled:
        assert owners == []
        return
    assert owners
    for owner, task in owners:
        assert task["dependentTasks"] == ["publish"]
        prefix = task["inputs"]["parameters"]["published_prefix"]["taskOutputParameter"]
        assert prefix["producerTask"] == "publish"
        conditions = []
        while owner != "root":
            ((owner, _, caller),) = list(_tasks_calling(components, owner))
            if "triggerPolicy" in caller:
                conditions.append(caller["triggerPolicy"]["condition"])
        assert "inputs.parameter_values['pipelinechannel--export_uri'] != ''" in conditions
        assert any(c.endswith("gate-Output'] == 'promote'") for c in conditions), conditions
