"""pipelines.workbench: requirements, token, CA bundle and data connection of an RHOAI workbench."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipelines.kfp_client import KfpApiError, KfpConnection, get_run
from pipelines.workbench import (
    apply_data_connection,
    check_requirements,
    install_missing_requirements,
    workbench_connection,
    workbench_token,
)


def _pyproject(tmp_path: Path, *deps: str, extras: dict | None = None) -> Path:
    lines = ["[project]", 'name = "lingo-rl"', f"dependencies = {list(deps)!r}"]
    if extras:
        lines.append("[project.optional-dependencies]")
        lines += [f"{k} = {v!r}" for k, v in extras.items()]
    path = tmp_path / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class _Pip:
    """Records the pip command instead of running it."""

    def __init__(self, returncode: int = 0) -> None:
        self.commands: list[list[str]] = []
        self.constraints: list[str] = []
        self.returncode = returncode

    def __call__(self, command, **_):
        self.commands.append(command)
        self.constraints.append(Path(command[command.index("-c") + 1]).read_text())
        return subprocess.CompletedProcess(command, self.returncode, "", "ERROR: no network")


def test_the_projects_own_requirements_are_all_present_here():
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    check = check_requirements(pyproject, ["cluster"])
    assert check.missing == () and check.out_of_range == ()
    pip = _Pip()
    assert install_missing_requirements(pyproject, ["cluster"], run=pip) == []
    assert pip.commands == []


def test_only_what_is_missing_is_installed_with_torch_pinned(tmp_path):
    import torch

    pyproject = _pyproject(
        tmp_path,
        "torch>=2.6",
        "requests>=2",
        "lingo-rl[cluster]",  # the project's own extra: skipped
        "no-such-dist-for-lingo-tests>=1",
        "other-platform-only>=1; sys_platform == 'nonexistent'",
        extras={"cluster": ["another-missing-dist-for-lingo>=0.1"]},
    )
    pip = _Pip()

    installed = install_missing_requirements(pyproject, ["cluster"], run=pip)

    assert installed == ["no-such-dist-for-lingo-tests>=1", "another-missing-dist-for-lingo>=0.1"]
    (command,) = pip.commands
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert command[-2:] == installed
    base_version = torch.__version__
    assert pip.constraints == [f"torch=={base_version}\n"]


def test_torch_is_never_installed_nor_upgraded(tmp_path, caplog, monkeypatch):
    pip = _Pip()
    assert install_missing_requirements(_pyproject(tmp_path, "torch>=999"), run=pip) == []
    assert pip.commands == [] and "keeping the workbench's torch" in caplog.text

    missing_torch = _pyproject(tmp_path, "requests>=2")
    missing_torch.write_text(missing_torch.read_text().replace("requests>=2", "torch>=2"))
    import importlib.metadata

    real_version = importlib.metadata.version

    def no_torch(name):
        if name == "torch":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", no_torch)
    with pytest.raises(RuntimeError, match="torch is not installed.*PyTorch or CUDA"):
        install_missing_requirements(missing_torch, run=pip)
    assert pip.commands == []


def test_an_imported_package_out_of_range_asks_for_a_restart(tmp_path):
    import requests  # noqa: F401  (imported: cannot be swapped in this process)

    with pytest.raises(RuntimeError, match=r"requests .* already imported .*restart the kernel"):
        install_missing_requirements(_pyproject(tmp_path, "requests>=999"), run=_Pip())


def test_a_failed_pip_is_an_error_with_its_message(tmp_path):
    with pytest.raises(RuntimeError, match="pip install no-such-dist-x>=1 failed.*no network"):
        install_missing_requirements(
            _pyproject(tmp_path, "no-such-dist-x>=1"), run=_Pip(returncode=1)
        )


def test_an_unknown_extra_is_named(tmp_path):
    with pytest.raises(ValueError, match="no extra 'gpu'"):
        check_requirements(_pyproject(tmp_path, "requests"), ["gpu"])


def test_the_token_comes_from_env_then_service_account_then_oc(tmp_path):
    token_file = tmp_path / "token"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    oc = bin_dir / "oc"
    oc.write_text("#!/bin/sh\n[ \"$1 $2\" = 'whoami -t' ] && echo sha256~from-oc\n")
    oc.chmod(0o755)
    env = {"PATH": str(bin_dir)}

    assert workbench_token(env, token_file) == ("sha256~from-oc", "oc whoami -t")
    token_file.write_text("service-account-jwt\n")
    assert workbench_token(env, token_file) == ("service-account-jwt", str(token_file))
    assert workbench_token({**env, "KFP_TOKEN": "t0"}, token_file) == ("t0", "KFP_TOKEN")
    assert workbench_token({"PATH": str(tmp_path / "none")}, tmp_path / "no-token") == (
        None,
        "none",
    )


def test_the_connection_needs_an_endpoint_and_an_existing_ca_bundle(tmp_path):
    with pytest.raises(ValueError, match="set KFP_ENDPOINT"):
        workbench_connection(environ={}, token_file=tmp_path / "none")
    with pytest.raises(ValueError, match="CA bundle '/no/ca.pem': no such file"):
        workbench_connection(
            environ={"KFP_ENDPOINT": "https://x", "KFP_CA_BUNDLE": "/no/ca.pem"},
            token_file=tmp_path / "none",
        )
    conn, source = workbench_connection(
        environ={"KFP_ENDPOINT": "https://dsp.example", "KFP_TOKEN": "t"},
        token_file=tmp_path / "none",
    )
    assert (conn.endpoint, conn.token, conn.ca_bundle, source) == (
        "https://dsp.example",
        "t",
        None,
        "KFP_TOKEN",
    )


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A CA certificate and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lingo test cluster CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, server_file = tmp_path / "ca.pem", tmp_path / "server.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_file.write_bytes(
        server.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_file, server_file


def test_the_ca_bundle_is_what_verifies_the_route(tmp_path, monkeypatch):
    """An HTTPS server whose certificate a private CA signs: refused without the bundle,
    answered with it."""
    ca_file, server_file = _self_signed(tmp_path)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            body = b'{"run_id": "r1", "state": "RUNNING"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"https://127.0.0.1:{server.server_address[1]}"
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    try:
        with pytest.raises(KfpApiError, match="no response.*CERTIFICATE_VERIFY_FAILED"):
            get_run(KfpConnection(endpoint, timeout_s=10), "r1")
        conn, _ = workbench_connection(
            environ={"KFP_ENDPOINT": endpoint, "KFP_CA_BUNDLE": str(ca_file)},
            token_file=tmp_path / "none",
        )
        assert get_run(conn, "r1").state == "RUNNING"
    finally:
        server.shutdown()
        server.server_close()


def test_a_data_connection_is_mapped_to_boto3s_names():
    env = {
        "AWS_S3_ENDPOINT": "https://s3.openshift-storage.svc",
        "AWS_S3_BUCKET": "pipelines",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "",
    }
    assert apply_data_connection(env) == "pipelines"
    assert env["AWS_ENDPOINT_URL"] == "https://s3.openshift-storage.svc"
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"

    kept = {**env, "AWS_ENDPOINT_URL": "http://minio:9000", "AWS_DEFAULT_REGION": "eu-west-1"}
    apply_data_connection(kept)
    assert (kept["AWS_ENDPOINT_URL"], kept["AWS_DEFAULT_REGION"]) == (
        "http://minio:9000",
        "eu-west-1",
    )
    with pytest.raises(ValueError, match="AWS_S3_BUCKET, AWS_SECRET_ACCESS_KEY not set"):
        apply_data_connection({"AWS_ACCESS_KEY_ID": "k"})
