"""What a Kubernetes API server checks when a custom resource is created, for the cluster tests.

No API server can run here. These are its checks, read from the CRDs themselves (copies of the
upstream files in ``tests/cluster/crds/``):

1. the served version's ``openAPIV3Schema``, with a real JSON-schema validator (types,
   required fields, enums, patterns, bounds); unknown fields are errors, as the structural
   schema prunes them (a field the server drops is a setting lost);
2. the list-type rules, which JSON-schema validators ignore: ``x-kubernetes-list-type: map``
   (no two items share the ``x-kubernetes-list-map-keys``: a container's ``env`` by ``name``,
   the server answers 422 "Duplicate value") and ``set`` (no two equal items);
3. the CEL rules (``x-kubernetes-validations``) evaluated with ``cel-python`` on the node they
   are attached to; transition rules (those reading ``oldSelf``) apply only to updates, which
   the project never sends, and are left out;
4. the object's metadata, which the server validates natively: the name (a DNS subdomain),
   label keys and values, annotation keys.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import celpy
import jsonschema
import yaml
from celpy import celtypes

CRDS = Path(__file__).parent / "cluster" / "crds"
CRD_FILES = {
    "PyTorchJob": "v1.9.0_kubeflow.org_pytorchjobs.yaml",
    "TrainJob": "v2.3.0_trainer.kubeflow.org_trainjobs.yaml",
    "ClusterTrainingRuntime": "v2.3.0_trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "TrainingRuntime": "v2.3.0_trainer.kubeflow.org_trainingruntimes.yaml",
    "InferenceService": "v0.20.0_serving.kserve.io_inferenceservices.trimmed.yaml",
}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@functools.cache
def crd(kind: str) -> dict:
    """The CRD of ``kind`` (parsed once)."""
    return yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=yaml.CSafeLoader)


def served_schema(kind: str, api_version: str) -> dict:
    """The ``openAPIV3Schema`` of the served version ``api_version`` (``group/version``).

    Raises:
        AssertionError: the CRD does not serve that group version.
    """
    definition = crd(kind)
    group, version = api_version.split("/")
    assert definition["spec"]["group"] == group, f"{kind}: group {group}, CRD has another"
    (served,) = [
        v for v in definition["spec"]["versions"] if v["name"] == version and v.get("served")
    ] or [None]
    assert served, f"{kind}: the CRD serves no version {version}"
    return served["schema"]["openAPIV3Schema"]


def _closed(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` wherever the structural schema would
    prune unknown fields (an object with ``properties`` that preserves nothing unknown)."""
    schema = copy.deepcopy(schema)

    def close(node: dict) -> None:
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for child in (node.get("properties") or {}).values():
            close(child)
        for key in ("items", "additionalProperties"):
            close(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key) or []:
                close(child)

    close(schema)
    return schema


@functools.cache
def _validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_closed(served_schema(kind, api_version)))


def _children(value, schema: dict, path: str):
    """``(child value, child schema, child path)`` of a value under its schema."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, child in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield child, sub, f"{path}.{key}"
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield child, schema.get("items") or {}, f"{path}[{index}]"


def list_type_errors(value, schema: dict, path: str = "") -> list[str]:
    """Breaches of ``x-kubernetes-list-type`` ``map`` (keys unique) and ``set`` (items
    unique) anywhere in ``value``."""
    errors = []
    if isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = schema["x-kubernetes-list-map-keys"]
            seen: set = set()
            for item in value:
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key, strict=True))
                    errors.append(f"{path}: Duplicate value: {{{shown}}}")
                seen.add(key)
        elif list_type == "set":
            texts = [json.dumps(item, sort_keys=True) for item in value]
            errors += [
                f"{path}: Duplicate value: {t}" for t in sorted(set(texts)) if texts.count(t) > 1
            ]
    for child, sub, child_path in _children(value, schema, path):
        errors += list_type_errors(child, sub, child_path)
    return errors


def cel_rules(schema: dict, path: str = "") -> list[tuple[str, str, str]]:
    """Every ``(path, rule, message)`` of the schema's CEL rules, transition rules included."""
    found = [
        (path, r["rule"], r.get("message", ""))
        for r in schema.get("x-kubernetes-validations") or []
    ]
    for key, child in (schema.get("properties") or {}).items():
        found += cel_rules(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += cel_rules(schema[key], f"{path}[]" if key == "items" else f"{path}{{}}")
    return found


@functools.cache
def _program(rule: str):
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def cel_errors(value, schema: dict, path: str = "", evaluated: list | None = None) -> list[str]:
    """The CEL rules ``value`` breaks, each evaluated with ``self`` bound to its node (rules
    reading ``oldSelf`` apply to updates only and are skipped); the rules evaluated are
    appended to ``evaluated``."""
    errors = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule["rule"]:
            continue
        if evaluated is not None:
            evaluated.append(rule["rule"])
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celtypes.BoolType) and bool(result)):  # or an error
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])} ({result!r})")
    for child, sub, child_path in _children(value, schema, path):
        errors += cel_errors(child, sub, child_path, evaluated)
    return errors


def _qualified_name(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_NAME_PART.match(name))


def metadata_errors(manifest: dict) -> list[str]:
    """What the API server's ObjectMeta validation refuses: the name, label keys and values,
    annotation keys (k8s.io/apimachinery ``ValidateObjectMeta``)."""
    meta = manifest.get("metadata") or {}
    errors = []
    name = meta.get("name", "")
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    for key, value in (meta.get("labels") or {}).items():
        if not _qualified_name(key):
            errors.append(f"metadata.labels: key {key!r} is not a qualified name")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(f"metadata.labels[{key}]: {value!r} is not a label value")
    for key, value in (meta.get("annotations") or {}).items():
        if not _qualified_name(key):
            errors.append(f"metadata.annotations: key {key!r} is not a qualified name")
        if not isinstance(value, str):
            errors.append(f"metadata.annotations[{key}]: {value!r} is not a string")
    return errors


def api_server_errors(manifest: dict, evaluated: list | None = None) -> list[str]:
    """Everything an API server would refuse in a create of ``manifest`` (empty: accepted)."""
    kind, api_version = manifest["kind"], manifest["apiVersion"]
    schema = served_schema(kind, api_version)
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in _validator(kind, api_version).iter_errors(manifest)
    ]
    errors += list_type_errors(manifest, schema)
    errors += cel_errors(manifest, schema, evaluated=evaluated)
    return errors + metadata_errors(manifest)


_DOMAIN_PREFIXED_PATH = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/.+$"
)
TORCHRUN_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                         "PET_MASTER_PORT"}  # fmt: skip


def trainer_webhook_errors(trainjob: dict, runtime: dict) -> list[str]:
    """What the Trainer's validating webhook (kubeflow/trainer v2.3.0) refuses in a TrainJob
    that references ``runtime``, beyond the CRD:

    - ``pkg/runtime/framework/plugins/torch/torch.go`` ``Validate``: "must not have reserved
      envs" (``spec.trainer.env`` naming ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
      ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``);
    - ``pkg/runtime/framework/plugins/jobset/jobset.go`` ``Validate``: each runtime patch's
      ``manager`` is a domain-prefixed path (``validation.IsDomainPrefixedPath``); a patch
      "must not have replicated job that doesn't exist in the runtime job template", "must not
      have container that doesn't exist in the runtime job", and "must not have envs for the
      dataset-initializer, model-initializer, node containers";
    - ``pkg/runtime/core/trainingruntime.go`` (line 306) and ``clustertrainingruntime.go``:
      the referenced runtime must exist (here: the TrainJob names ``runtime``, of its kind; a
      TrainingRuntime in the TrainJob's namespace);
    - ``pkg/webhooks/trainingruntime_webhook.go`` ``validateReplicatedJobs`` (both runtime
      kinds): a replicated job labelled as the ``trainer`` ancestor has ``replicas`` 1 (the
      default) and a ``node`` container.
    """
    spec = trainjob["spec"]
    errors = []
    ref = spec["runtimeRef"]
    if ref["name"] != runtime["metadata"]["name"] or ref.get("kind") != runtime["kind"]:
        errors.append(f"spec.runtimeRef: {ref['kind']} {ref['name']!r} is not the runtime")
    namespace = runtime["metadata"].get("namespace")
    if runtime["kind"] == "TrainingRuntime" and namespace != trainjob["metadata"]["namespace"]:
        errors.append(f"spec.runtimeRef: TrainingRuntime in namespace {namespace!r}")
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        labels = (job["template"].get("metadata") or {}).get("labels") or {}
        if labels.get("trainer.kubeflow.org/trainjob-ancestor-step") != "trainer":
            continue
        if job.get("replicas", 1) != 1:
            errors.append(f"runtime: replicated job {job['name']!r}: replicas must be 1")
        containers = job["template"]["spec"]["template"]["spec"]["containers"]
        if "node" not in {c["name"] for c in containers}:
            errors.append(f"runtime: replicated job {job['name']!r} has no 'node' container")
    reserved = sorted({e["name"] for e in spec["trainer"].get("env") or []} & TORCHRUN_RESERVED_ENV)
    if reserved:
        errors.append(f"spec.trainer.env: must not have reserved envs {reserved}")
    jobs = {
        job["name"]: {c["name"] for c in job["template"]["spec"]["template"]["spec"]["containers"]}
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
    }
    for patch in spec.get("runtimePatches") or []:
        if not _DOMAIN_PREFIXED_PATH.match(patch["manager"]):
            errors.append(
                f"runtimePatches: manager {patch['manager']!r} is no domain-prefixed path"
            )
        template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        for job in (template.get("spec") or {}).get("replicatedJobs") or []:
            if job["name"] not in jobs:
                errors.append(f"runtimePatches: no replicated job {job['name']!r} in the runtime")
                continue
            pod = ((job.get("template") or {}).get("spec") or {}).get("template") or {}
            for container in (pod.get("spec") or {}).get("containers") or []:
                if container["name"] not in jobs[job["name"]]:
                    errors.append(f"runtimePatches: no container {container['name']!r}")
                elif container.get("env") and container["name"] == "node":
                    errors.append("runtimePatches: must not have envs for the node container")
    return errors


K8S_SCHEMAS = Path(__file__).parent / "cluster" / "k8s_schemas" / "v1.33.0-local-strict.json"
CORE_MODELS = {
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "PersistentVolumeClaim": "V1PersistentVolumeClaim",
    "Secret": "V1Secret",
}
"""The built-in kinds ``lingo cluster setup`` creates, and the ``kubernetes`` client's model of
each (its setters refuse a missing required field)."""


@functools.cache
def _core_validator(kind: str) -> jsonschema.Draft202012Validator:
    bundle = json.loads(K8S_SCHEMAS.read_text())
    schema = {"$defs": bundle["$defs"], "kinds": bundle["kinds"], "$ref": f"#/kinds/{kind}"}
    return jsonschema.Draft202012Validator(schema)


def _model_errors(manifest: dict) -> list[str]:
    """What the ``kubernetes`` client's model of the kind refuses (required fields)."""
    from kubernetes.client import ApiClient

    try:
        ApiClient()._ApiClient__deserialize(manifest, CORE_MODELS[manifest["kind"]])
    except ValueError as error:
        return [f"model: {error}"]
    return []


def _rbac_errors(manifest: dict) -> list[str]:
    """The RBAC API's own validation (k8s.io/kubernetes v1.33 ``pkg/apis/rbac/validation/
    validation.go``): a rule has verbs, and a rule naming resources names API groups; a Role's
    rules name no ``nonResourceURLs``; a RoleBinding's ``roleRef`` is a Role or ClusterRole of
    ``rbac.authorization.k8s.io``, and a ServiceAccount subject has the core group and a name."""
    errors = []
    for index, rule in enumerate(manifest.get("rules") or []):
        if not rule.get("verbs"):
            errors.append(f"rules[{index}].verbs: at least one verb is required")
        if rule.get("resources") and not rule.get("apiGroups"):
            errors.append(f"rules[{index}].apiGroups: required with resources")
        if manifest["kind"] == "Role" and rule.get("nonResourceURLs"):
            errors.append(f"rules[{index}].nonResourceURLs: not allowed in a namespaced Role")
    if manifest["kind"] == "RoleBinding":
        ref = manifest.get("roleRef") or {}
        if ref.get("apiGroup") != "rbac.authorization.k8s.io":
            errors.append(f"roleRef.apiGroup: {ref.get('apiGroup')!r} is not supported")
        if ref.get("kind") not in ("Role", "ClusterRole"):
            errors.append(f"roleRef.kind: {ref.get('kind')!r} is not Role or ClusterRole")
        for index, subject in enumerate(manifest.get("subjects") or []):
            if subject.get("kind") == "ServiceAccount" and subject.get("apiGroup", ""):
                errors.append(f"subjects[{index}].apiGroup: must be '' for a ServiceAccount")
            if not subject.get("name"):
                errors.append(f"subjects[{index}].name: required")
    return errors


def _claim_errors(manifest: dict) -> list[str]:
    """The core API's PVC validation (``pkg/apis/core/validation/validation.go``,
    ``ValidatePersistentVolumeClaimSpec``): access modes given and known, a storage request."""
    spec = manifest.get("spec") or {}
    errors = []
    modes = spec.get("accessModes") or []
    known = {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"}
    if not modes or set(modes) - known:
        errors.append(f"spec.accessModes: {modes!r}: at least one of {sorted(known)}")
    if "storage" not in ((spec.get("resources") or {}).get("requests") or {}):
        errors.append("spec.resources.requests.storage: required")
    return errors


def core_api_errors(manifest: dict) -> list[str]:
    """Everything an API server would refuse in a create of a built-in ``manifest`` (Role,
    RoleBinding, PersistentVolumeClaim, Secret; empty: accepted): the Kubernetes 1.33 JSON
    schema of the kind (strict: unknown fields refused), the ``kubernetes`` client's model,
    the kind's own validation rules, and the metadata."""
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in _core_validator(manifest["kind"]).iter_errors(manifest)
    ]
    errors += _model_errors(manifest)
    if manifest["kind"] in ("Role", "RoleBinding"):
        errors += _rbac_errors(manifest)
    if manifest["kind"] == "PersistentVolumeClaim":
        errors += _claim_errors(manifest)
    return errors + metadata_errors(manifest)
