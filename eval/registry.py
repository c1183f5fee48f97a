"""MLflow model registry operations of the promotion gate (``mlflow-skinny`` is enough).

A model is identified by the **content hash** of its directory (``content_sha256``: SHA-256
over every file's relative path, size and bytes, in sorted order), stored as the version tag
``lingo.content_sha256``. Registering a directory whose hash is already a version of the
registered model reuses that version, so re-running the gate on the same weights never adds
a version. The eval metrics of the run that promoted a version are stored as version tags
``lingo.eval.<metric>``; they are what a later candidate must beat.

Registration uploads the directory as the artifacts (``model/``) of an MLflow run and creates
the version from that run's artifact URI, which works against a ``mlflow server`` that proxies
artifacts (``mlflow-artifacts:/…``) as well as against a local store.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from core.tracking import use_experiment

log = logging.getLogger(__name__)

HASH_TAG = "lingo.content_sha256"
METRIC_TAG_PREFIX = "lingo.eval."
FOOTING_TAG = "lingo.eval_footing"
"""SHA-256 of the eval footing (questions, limit, languages, sampling, prompts) the version
was promoted on (``eval.gate.EvalFooting``)."""
FOOTING_TEXT_TAG = "lingo.eval_footing_text"
DATA_FINGERPRINT_TAG = "lingo.data_fingerprint"
"""The data fingerprint of the run that trained the version (``data_prep.fingerprint``)."""
_CHUNK = 1 << 20


def content_sha256(model_dir: str | Path) -> str:
    """SHA-256 of a directory's files (relative paths, sizes and contents, sorted by path).

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory or holds no file.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"model directory {root} holds no file")
    digest = hashlib.sha256()
    for path in files:
        relative = path.relative_to(root).as_posix()
        digest.update(f"{relative}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class RegisteredVersion:
    """A model version as the gate sees it.

    Attributes:
        version: The version number (a string, as MLflow returns it).
        content_sha256: Its content hash tag, if any.
        metrics: Its ``lingo.eval.<metric>`` tags as floats.
        source: Where its files are.
        eval_footing: The ``FOOTING_TAG`` it was promoted on, if recorded.
        eval_footing_text: Its readable form.
        data_fingerprint: The ``DATA_FINGERPRINT_TAG`` of its training data, if recorded.
    """

    version: str
    content_sha256: str | None
    metrics: dict[str, float]
    source: str
    eval_footing: str | None = None
    eval_footing_text: str | None = None
    data_fingerprint: str | None = None


def _metric_tags(metrics: dict[str, float | None]) -> dict[str, str]:
    return {
        f"{METRIC_TAG_PREFIX}{key}": repr(float(value))
        for key, value in metrics.items()
        if value is not None and math.isfinite(value)
    }


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def _as_version(model_version) -> RegisteredVersion:
    metrics = {}
    for key, value in (model_version.tags or {}).items():
        if key.startswith(METRIC_TAG_PREFIX):
            try:
                metrics[key[len(METRIC_TAG_PREFIX) :]] = float(value)
            except ValueError:
                log.warning(
                    "version %s: tag %s=%r is not a number", model_version.version, key, value
                )
    tags = model_version.tags or {}
    return RegisteredVersion(
        version=str(model_version.version),
        content_sha256=tags.get(HASH_TAG),
        metrics=metrics,
        source=model_version.source,
        eval_footing=tags.get(FOOTING_TAG),
        eval_footing_text=tags.get(FOOTING_TEXT_TAG),
        data_fingerprint=tags.get(DATA_FINGERPRINT_TAG),
    )


def _registered_model(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def aliased_version(name: str, alias: str) -> RegisteredVersion | None:
    """The version that ``alias`` points to, or ``None`` (no such model or alias)."""
    client = _client()
    model = _registered_model(client, name)
    if model is None or alias not in (model.aliases or {}):
        return None
    return _as_version(client.get_model_version(name, model.aliases[alias]))


def find_version(name: str, sha256: str) -> RegisteredVersion | None:
    """The lowest version of ``name`` whose content hash is ``sha256``, or ``None``."""
    client = _client()
    if _registered_model(client, name) is None:
        return None
    versions = client.search_model_versions(f"name='{name}' and tags.`{HASH_TAG}`='{sha256}'")
    if not versions:
        return None
    return _as_version(min(versions, key=lambda v: int(v.version)))


def register_directory(
    name: str,
    model_dir: str | Path,
    sha256: str,
    metrics: dict[str, float],
    tags: dict[str, str] | None = None,
) -> RegisteredVersion:
    """Upload ``model_dir`` to a new MLflow run and register it as a new version of ``name``.

    Args:
        name: Registered model name (created when missing).
        model_dir: The Hugging Face model directory.
        sha256: Its ``content_sha256`` (stored as a tag).
        metrics: Eval metrics to store as ``lingo.eval.<metric>`` tags (non-finite skipped).
        tags: Further version tags.
    """
    import mlflow

    client = _client()
    if _registered_model(client, name) is None:
        client.create_registered_model(name, description="lingo-rl GRPO models (gpt-oss)")
    use_experiment()
    nested = mlflow.active_run() is not None
    with mlflow.start_run(run_name=f"register-{name}", nested=nested) as run:
        mlflow.log_artifacts(str(model_dir), artifact_path="model")
        mlflow.set_tag(HASH_TAG, sha256)
    version_tags = {HASH_TAG: sha256, **(tags or {})}
    version_tags.update(_metric_tags(metrics))
    created = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id, tags=version_tags
    )
    log.info("registered %s version %s from %s", name, created.version, model_dir)
    return _as_version(created)


def set_alias(name: str, alias: str, version: str) -> None:
    """Point ``alias`` of ``name`` at ``version``."""
    _client().set_registered_model_alias(name, alias, version)


def update_metric_tags(
    name: str, version: str, metrics: dict[str, float | None], tags: dict[str, str] | None = None
) -> None:
    """Overwrite the ``lingo.eval.<metric>`` tags of a version with newer eval values, and
    set ``tags``."""
    client = _client()
    for key, value in (_metric_tags(metrics) | (tags or {})).items():
        client.set_model_version_tag(name, version, key, value)


def download_version(version: RegisteredVersion, destination: str | Path) -> Path:
    """Download a version's files (its ``source``) into the directory ``destination``
    (created; it must be empty or absent).

    Raises:
        FileExistsError: ``destination`` holds files.
    """
    import shutil
    import tempfile

    from mlflow.artifacts import download_artifacts

    target = Path(destination)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target}: not empty; the champion is downloaded into a new folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".champion-", dir=target.parent) as work:
        local = Path(download_artifacts(artifact_uri=version.source, dst_path=work))
        if target.exists():
            target.rmdir()
        shutil.move(str(local), target)  # same file system: a rename
    log.info("downloaded version %s (%s) to %s", version.version, version.source, target)
    return target
