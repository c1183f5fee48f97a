"""Serving the champion on a cluster: a KServe InferenceService running vLLM on the published
model, applied by the pipeline's ``deploy`` step when the gate promotes.

The InferenceService (``serving.kserve.io/v1beta1``) names a vLLM ServingRuntime that the
cluster already has (``ServingConfig.runtime``: OpenShift AI's "vLLM NVIDIA GPU ServingRuntime
for KServe" template, or KServe's own); KServe's storage initializer downloads
``storageUri`` (the ``grpo-model/`` folder ``publish`` uploaded) to ``/mnt/models``, which the
runtime serves. ``model.args`` are appended to the runtime's: gpt-oss's reasoning parser
(``--reasoning-parser openai_gptoss``, vLLM's name for it), the served name, the tensor
parallel size (the GPUs asked for), the context length.

The manifest is checked against the InferenceService CRD (``tests/cluster/crds``); applying
creates it, or patches the one already there to it (a merge patch: the next revision;
with ``canary_traffic_percent`` KServe sends that share to it and the rest to the previous
one, which is also how to roll back: ``canaryTrafficPercent: 0``).
"""

from __future__ import annotations

import copy
import logging
import re
import time
from typing import Literal

from pydantic import Field, field_validator

from cluster.access import SERVING_GROUP, SERVING_PLURAL
from core.config_model import ConfigModel

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = SERVING_GROUP, "v1beta1", SERVING_PLURAL
API_VERSION = f"{GROUP}/{VERSION}"
REASONING_PARSER = "openai_gptoss"
"""vLLM's reasoning parser for gpt-oss (``vllm.reasoning``'s registry name, vLLM 0.10 on)."""
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
OPTIONAL_PREDICTOR_FIELDS = ("canaryTrafficPercent", "serviceAccountName")
"""Predictor fields set only by some configs: a patch that leaves them out removes them."""
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 45
"""KServe derives ``<name>-predictor-<namespace>`` host names and Knative revision names from
the InferenceService name; its webhook refuses longer names than this leaves room for."""


class ServingConfig(ConfigModel):
    """How the champion is served on a cluster (``deploy``; ``lingo serve`` locally).

    Attributes:
        enabled: Whether the pipeline has a ``deploy`` step (cluster presets); it runs only
            when the gate promotes and the model was published (``export_uri`` set).
        name: The InferenceService's name (a DNS-1035 label); also the served model name.
        namespace: Where it goes; empty: the deploy step's own namespace.
        runtime: The vLLM ServingRuntime (or ClusterServingRuntime) it names.
        model_format: The ``modelFormat`` that runtime supports.
        gpus: GPUs of one replica (and vLLM's tensor parallel size); None: the preset's GRPO
            engines' ``grpo.rollout.tensor_parallel_size`` (they served this model on these
            machines during training).
        gpu_resource: The extended resource the GPUs are asked for with.
        cpu: CPU request of one replica.
        memory: Memory request and limit of one replica (Kubernetes quantity).
        max_model_len: vLLM's context length (``--max-model-len``); None: the model's.
        min_replicas: ``minReplicas`` (0 lets a serverless deployment scale to zero).
        max_replicas: ``maxReplicas``.
        canary_traffic_percent: Share of requests the new revision gets when it replaces a
            running one (KServe serverless mode); None: all of them at once.
        deployment_mode: ``Serverless`` or ``RawDeployment`` (annotation); None: the cluster's.
        service_account: Service account whose secret holds the object storage credentials
            KServe's storage initializer uses; None: the namespace's default.
        ready_timeout_s: How long ``deploy`` waits for the InferenceService to be Ready (0:
            does not wait).
    """

    enabled: bool = False
    name: str = "lingo-gpt-oss"
    namespace: str = ""
    runtime: str = "vllm-runtime"
    model_format: str = "vLLM"
    gpus: int | None = Field(None, ge=1)
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = "8"
    memory: str = "64Gi"
    max_model_len: int | None = Field(8192, ge=256)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    canary_traffic_percent: int | None = Field(None, ge=0, le=100)
    deployment_mode: Literal["Serverless", "RawDeployment"] | None = None
    service_account: str | None = None
    ready_timeout_s: float = Field(1800.0, ge=0.0)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not _DNS_1035.match(value) or len(value) > MAX_NAME:
            raise ValueError(
                f"serving.name {value!r}: an InferenceService name is lower-case letters, "
                f"digits and '-', starts with a letter, at most {MAX_NAME} characters"
            )
        return value


def published_model_uri(published_prefix: str) -> str:
    """Where ``publish`` put the GRPO model under its ``<export_uri>/<run id>`` prefix."""
    return f"{published_prefix.rstrip('/')}/grpo-model/"


def inference_service(
    config: ServingConfig, storage_uri: str, namespace: str, labels: dict[str, str] | None = None
) -> dict:
    """The InferenceService that serves ``storage_uri`` with vLLM as ``config`` says.

    Raises:
        ValueError: ``config.gpus`` is not resolved (None), or the URI is not s3/gs/pvc/hf.
    """
    if config.gpus is None:
        raise ValueError("serving.gpus: not resolved (the preset gives it; see step_configs)")
    if not storage_uri.startswith(("s3://", "gs://", "pvc://", "hf://", "https://")):
        raise ValueError(
            f"storage URI {storage_uri!r}: KServe's storage initializer reads s3://, gs://, "
            "pvc://, hf:// or https://"
        )
    args = [
        f"--served-model-name={config.name}",
        f"--reasoning-parser={REASONING_PARSER}",
        f"--tensor-parallel-size={config.gpus}",
    ]
    if config.max_model_len is not None:
        args.append(f"--max-model-len={config.max_model_len}")
    gpus = str(config.gpus)
    predictor: dict = {
        "minReplicas": config.min_replicas,
        "maxReplicas": config.max_replicas,
        "model": {
            "modelFormat": {"name": config.model_format},
            "runtime": config.runtime,
            "storageUri": storage_uri,
            "args": args,
            "resources": {
                "requests": {
                    "cpu": config.cpu,
                    "memory": config.memory,
                    config.gpu_resource: gpus,
                },
                "limits": {"memory": config.memory, config.gpu_resource: gpus},
            },
        },
    }
    if config.canary_traffic_percent is not None:
        predictor["canaryTrafficPercent"] = config.canary_traffic_percent
    if config.service_account:
        predictor["serviceAccountName"] = config.service_account
    metadata: dict = {
        "name": config.name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/part-of": "lingo-rl", **(labels or {})},
    }
    if config.deployment_mode:
        metadata["annotations"] = {DEPLOYMENT_MODE: config.deployment_mode}
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {"predictor": predictor},
    }


def apply_inference_service(api_client, manifest: dict) -> str:
    """Create the InferenceService, or patch the one of that name to it (a new revision).

    Returns:
        ``created`` or ``replaced``.

    Raises:
        kubernetes.client.ApiException: anything but a 409 on create (403: see
            ``cluster.access.DEPLOY_ACCESS``).
    """
    from kubernetes import client as k8s
    from kubernetes.client import ApiException

    api = k8s.CustomObjectsApi(api_client)
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
        log.info("created InferenceService %s/%s", namespace, name)
        return "created"
    except ApiException as error:
        if error.status != 409:
            raise
    # a JSON merge patch (RFC 7386): the fields this module sets take the new values, the
    # optional ones it leaves out are removed (null), every other field stays
    patch = copy.deepcopy(manifest)
    predictor = patch["spec"]["predictor"]
    for optional in OPTIONAL_PREDICTOR_FIELDS:
        predictor.setdefault(optional, None)
    patch["metadata"] = {"labels": manifest["metadata"]["labels"]}
    mode = (manifest["metadata"].get("annotations") or {}).get(DEPLOYMENT_MODE)
    patch["metadata"]["annotations"] = {DEPLOYMENT_MODE: mode}
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)
    log.info("patched InferenceService %s/%s (a new revision)", namespace, name)
    return "replaced"


class NotReadyError(RuntimeError):
    """The InferenceService did not become Ready in time; the message has its condition."""


def wait_ready(
    api_client,
    namespace: str,
    name: str,
    timeout_s: float,
    poll_s: float = 10.0,
    sleep=time.sleep,
) -> str:
    """Wait for the InferenceService's ``Ready`` condition; returns its ``status.url``.

    Raises:
        NotReadyError: ``timeout_s`` passed; names the Ready condition's reason and message.
    """
    from kubernetes import client as k8s

    api = k8s.CustomObjectsApi(api_client)
    deadline = time.monotonic() + timeout_s
    while True:
        status = (
            api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name).get("status")
            or {}
        )
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        if ready.get("status") == "True":
            return status.get("url") or ""
        if time.monotonic() >= deadline:
            raise NotReadyError(
                f"InferenceService {namespace}/{name} not Ready after {timeout_s:.0f} s: "
                f"{ready.get('reason') or 'no Ready condition yet'} "
                f"{ready.get('message') or ''}".rstrip()
                + f" (kubectl describe inferenceservice {name} -n {namespace})"
            )
        sleep(poll_s)


def deploy_champion(
    published_prefix: str, config: dict, pipeline_run_id: str, api_client=None
) -> str:
    """The ``deploy`` step: serve the model ``publish`` put under ``published_prefix``.

    Checks the access first (one line naming what is missing), applies the InferenceService
    (labelled with the pipeline run), waits for it to be Ready (``ready_timeout_s``).

    Returns:
        Its URL (``status.url``); empty when not waited for.

    Raises:
        cluster.access.AccessDenied: the step's service account may not create, read or patch
            InferenceServices there (``lingo cluster setup`` grants it).
        NotReadyError: not Ready in time.
    """
    from cluster.access import DEPLOY_ACCESS, check_access
    from cluster.launcher import default_api_client
    from cluster.step_job import current_namespace

    serving = ServingConfig.model_validate(config)
    namespace = serving.namespace or current_namespace()
    api_client = api_client or default_api_client()
    check_access(api_client, namespace, list(DEPLOY_ACCESS))
    uri = published_model_uri(published_prefix)
    manifest = inference_service(
        serving, uri, namespace, {"lingo-rl/pipeline-run-id": pipeline_run_id[:63]}
    )
    action = apply_inference_service(api_client, manifest)
    log.info("InferenceService %s/%s %s: vLLM serving %s", namespace, serving.name, action, uri)
    if serving.ready_timeout_s == 0:
        return ""
    url = wait_ready(api_client, namespace, serving.name, serving.ready_timeout_s)
    log.info("ready: %s (OpenAI API under /v1, model %r)", url, serving.name)
    return url
