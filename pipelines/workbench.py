"""What a Red Hat OpenShift AI workbench gives the notebook, read the way the project needs it.

- **Requirements** (``install_missing_requirements``): the project's dependencies that the
  workbench image lacks are installed into the running kernel's environment; nothing already
  installed is replaced (torch above all: the workbench's CUDA build stays), so no kernel
  restart is needed. A dependency whose installed version is out of range and already imported
  cannot be swapped in a live kernel: that is an error that says so.
- **The pipeline server** (``workbench_connection``): ``KFP_ENDPOINT`` (the Data Science
  Pipelines route), a bearer token from ``KFP_TOKEN``, else the workbench's mounted
  service-account token, else ``oc whoami -t``; a CA bundle from ``KFP_CA_BUNDLE`` (else
  ``requests`` uses ``REQUESTS_CA_BUNDLE``, which OpenShift AI sets in workbenches when the
  cluster has a trusted CA bundle).
- **Object storage** (``apply_data_connection``): a data connection's variables
  (``AWS_S3_ENDPOINT``, ``AWS_DEFAULT_REGION``, ``AWS_S3_BUCKET``, the keys) mapped to the
  names boto3 reads (``AWS_ENDPOINT_URL``).

Only the standard library is imported at module level: the first notebook cell imports this
module before the project's dependencies are known to be there.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.kfp_client import KfpConnection

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
"""Where Kubernetes mounts the pod's service-account token (a workbench's included)."""
ENDPOINT_ENV = "KFP_ENDPOINT"
CA_BUNDLE_ENV = "KFP_CA_BUNDLE"
TOKEN_ENV = "KFP_TOKEN"
NEVER_INSTALLED = frozenset({"torch"})
"""Distributions this module never installs or upgrades: the workbench image's own build."""


# -- requirements ---------------------------------------------------------------------------


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it; every image with pip has this one
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


@dataclass(frozen=True)
class RequirementCheck:
    """The project's requirements as this environment holds them.

    Attributes:
        missing: requirement strings of distributions that are not installed.
        out_of_range: ``(requirement, installed version)`` of installed distributions whose
            version the requirement does not accept.
    """

    missing: tuple[str, ...]
    out_of_range: tuple[tuple[str, str], ...]


def check_requirements(pyproject: str | Path, extras: Sequence[str] = ()) -> RequirementCheck:
    """The dependencies (and ``extras``) of ``pyproject`` that this environment lacks.

    Raises:
        ValueError: an extra that ``pyproject`` does not define.
    """
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    strings = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"{pyproject}: no extra {extra!r} (has {', '.join(optional)})")
        strings += optional[extra]
    requirement = _requirement_class()
    project_name = project["name"]
    missing, out_of_range = [], []
    for text in strings:
        req = requirement(text)
        if req.name == project_name or (req.marker and not req.marker.evaluate()):
            continue  # the project's own extras (listed separately), other platforms
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out_of_range.append((text, version))
    return RequirementCheck(tuple(missing), tuple(out_of_range))


def _imported(distribution: str) -> list[str]:
    """Top-level modules of ``distribution`` that this process has already imported."""
    modules = [
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if distribution.lower().replace("_", "-") in {d.lower().replace("_", "-") for d in dists}
    ]
    return [m for m in modules if m in sys.modules]


def install_missing_requirements(
    pyproject: str | Path,
    extras: Sequence[str] = (),
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> list[str]:
    """Install what ``check_requirements`` finds lacking into this interpreter's environment.

    torch is never installed or replaced (``NEVER_INSTALLED``): its version is pinned as a pip
    constraint, so no other package can pull a different build in. Requirements whose module
    the kernel has not imported yet are importable right after, without a restart.

    Returns:
        The requirements installed (empty: nothing to do, pip not run).

    Raises:
        RuntimeError: torch is not installed; or a distribution is out of range and already
            imported in this kernel (restart the kernel and run this first); or pip failed.
    """
    requirement = _requirement_class()
    check = check_requirements(pyproject, extras)
    for text in check.missing:
        if requirement(text).name in NEVER_INSTALLED:
            raise RuntimeError(
                f"{requirement(text).name} is not installed, and this notebook does not install "
                "it: start the workbench from an image that has it (PyTorch or CUDA)"
            )
    install = list(check.missing)
    for text, version in check.out_of_range:
        name = requirement(text).name
        if name in NEVER_INSTALLED:
            logger.warning(
                "keeping the workbench's %s %s (the project asks %s)", name, version, text
            )
            continue
        imported = _imported(name)
        if imported:
            raise RuntimeError(
                f"{name} {version} is installed and already imported ({', '.join(imported)}), "
                f"but the project needs {text}: restart the kernel and run this cell first"
            )
        install.append(text)
    if not install:
        return []
    with tempfile.TemporaryDirectory(prefix="lingo-pip-") as tmp:
        constraints = Path(tmp) / "constraints.txt"
        pinned = []
        for name in sorted(NEVER_INSTALLED):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                pinned.append(f"{name}=={importlib.metadata.version(name)}\n")
        constraints.write_text("".join(pinned))
        command = [sys.executable, "-m", "pip", "install", "--quiet", "-c", str(constraints)]
        result = run([*command, *install], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip()[-2000:]
        raise RuntimeError(f"pip install {' '.join(install)} failed ({result.returncode}): {tail}")
    importlib.invalidate_caches()  # new packages on sys.path are found without a restart
    logger.info("installed %s", ", ".join(install))
    return install


# -- the pipeline server ----------------------------------------------------------------------


def workbench_token(
    environ: MutableMapping[str, str] = os.environ,
    token_file: Path = SERVICE_ACCOUNT_TOKEN,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> tuple[str | None, str]:
    """The bearer token for the pipeline server, and where it came from (never the token).

    In order: ``$KFP_TOKEN``; the workbench's service-account token (OpenShift AI gives a
    workbench's service account access to its project's pipeline server); ``oc whoami -t``
    when ``oc`` is on the PATH and logged in. ``(None, "none")`` when there is none.
    """
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV].strip(), TOKEN_ENV
    if token_file.is_file():
        token = token_file.read_text().strip()
        if token:
            return token, str(token_file)
    oc = shutil.which("oc", path=environ.get("PATH"))
    if oc:
        result = run([oc, "whoami", "-t"], capture_output=True, text=True, timeout=30)
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip(), "oc whoami -t"
    return None, "none"


def workbench_connection(
    endpoint: str | None = None,
    ca_bundle: str | None = None,
    environ: MutableMapping[str, str] = os.environ,
    token_file: Path = SERVICE_ACCOUNT_TOKEN,
) -> tuple[KfpConnection, str]:
    """A connection to the project's pipeline server, and where its token came from.

    Args:
        endpoint: the server's route (``https://ds-pipeline-dspa-<project>.apps.<cluster>``);
            default ``$KFP_ENDPOINT``.
        ca_bundle: PEM file of the CAs of the route's certificate; default ``$KFP_CA_BUNDLE``,
            else what ``requests`` trusts (``REQUESTS_CA_BUNDLE``, the system's CAs).
        environ: where the variables are read.
        token_file: the service-account token (see ``workbench_token``).

    Raises:
        ValueError: no endpoint; the CA bundle is not a file.
    """
    from pipelines.kfp_client import KfpConnection

    endpoint = endpoint or environ.get(ENDPOINT_ENV)
    if not endpoint:
        raise ValueError(
            f"no pipeline server: set {ENDPOINT_ENV} to its route, e.g. https://$(oc get route "
            "ds-pipeline-dspa -o jsonpath='{.spec.host}')"
        )
    token, source = workbench_token(environ, token_file)
    ca_bundle = ca_bundle or environ.get(CA_BUNDLE_ENV) or None
    return KfpConnection(endpoint, token=token, ca_bundle=ca_bundle), source


# -- object storage ----------------------------------------------------------------------------

DATA_CONNECTION_ENDPOINT = "AWS_S3_ENDPOINT"
DATA_CONNECTION_BUCKET = "AWS_S3_BUCKET"
DEFAULT_REGION = "us-east-1"


def apply_data_connection(environ: MutableMapping[str, str] = os.environ) -> str:
    """Map a data connection's variables to boto3's, in ``environ``; return its bucket.

    An OpenShift AI data connection (an S3 connection attached to the workbench) sets
    ``AWS_S3_ENDPOINT``, ``AWS_S3_BUCKET``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``; boto3 reads the endpoint from ``AWS_ENDPOINT_URL``. A value
    already in ``AWS_ENDPOINT_URL`` wins; a missing region becomes us-east-1 (S3-compatible
    stores accept any).

    Raises:
        ValueError: no bucket (``AWS_S3_BUCKET``) or no access key.
    """
    if environ.get(DATA_CONNECTION_ENDPOINT) and not environ.get("AWS_ENDPOINT_URL"):
        environ["AWS_ENDPOINT_URL"] = environ[DATA_CONNECTION_ENDPOINT]
    environ.setdefault("AWS_DEFAULT_REGION", DEFAULT_REGION)
    if not environ.get("AWS_DEFAULT_REGION"):
        environ["AWS_DEFAULT_REGION"] = DEFAULT_REGION
    missing = [
        name
        for name in (DATA_CONNECTION_BUCKET, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        if not environ.get(name)
    ]
    if missing:
        raise ValueError(
            f"data connection: {', '.join(missing)} not set; attach the pipeline server's data "
            "connection to the workbench (Workbench settings > Connections)"
        )
    return environ[DATA_CONNECTION_BUCKET]
