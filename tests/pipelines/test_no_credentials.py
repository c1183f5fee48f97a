"""No credential from the compiling machine's environment ends up in the compiled pipeline.

The pipeline is compiled for every preset in a fresh interpreter (so import-time reads of the
environment count too) with credential-looking variables set to random values; the YAML must
contain none of those values and nothing shaped like a key or token.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

from pipelines.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]

CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID": lambda: "AKIA" + secrets.token_hex(8).upper(),
    "AWS_SECRET_ACCESS_KEY": lambda: secrets.token_urlsafe(30),
    "MLFLOW_TRACKING_TOKEN": lambda: secrets.token_urlsafe(24),
    "MLFLOW_TRACKING_PASSWORD": lambda: secrets.token_urlsafe(16),
    "HF_TOKEN": lambda: "hf_" + secrets.token_hex(17),
    "OPENAI_API_KEY": lambda: "sk-" + secrets.token_urlsafe(32),
    "KFP_TOKEN": lambda: secrets.token_urlsafe(32),
}

TOKEN_SHAPES = {
    "AWS access key id": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
    "Hugging Face token": r"\bhf_[A-Za-z0-9]{30,}\b",
    "OpenAI-style key": r"\bsk-[A-Za-z0-9_\-]{20,}",
    "GitHub token": r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
    "bearer token": r"Bearer\s+[A-Za-z0-9._\-]{16,}",
    "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    "credentials in a URL": r"[a-z][a-z0-9+.\-]*://[^/\s:@'\"]+:[^/\s@'\"]+@",
}

COMPILE_ALL = """
import sys
from pathlib import Path
from pipelines.compile import compile_pipeline
from pipelines.presets import PRESETS
for preset in PRESETS.values():
    compile_pipeline(Path(sys.argv[1]) / f"{preset.name}.yaml", preset)
"""


def test_compiled_yaml_holds_no_credentials_from_the_environment(tmp_path):
    secrets_set = {name: make() for name, make in CREDENTIAL_ENV.items()}
    env = {**os.environ, **secrets_set}
    subprocess.run(
        [sys.executable, "-c", COMPILE_ALL, str(tmp_path)], cwd=ROOT, env=env, check=True
    )

    compiled = {p.stem: p.read_text() for p in tmp_path.glob("*.yaml")}
    assert set(compiled) == set(PRESETS)
    for preset, text in compiled.items():
        assert "lingo-rl" in text  # a real compiled pipeline, not an empty file
        for name, value in secrets_set.items():
            assert value not in text, f"{preset}: the value of ${name} is in the compiled YAML"
        for shape, pattern in TOKEN_SHAPES.items():
            match = re.search(pattern, text)
            assert match is None, f"{preset}: a {shape} in the compiled YAML: {match.group()!r}"


def test_the_token_shapes_catch_what_they_should():
    """The patterns above are not vacuous: each finds a value made like the ones set."""
    samples = " ".join(make() for make in CREDENTIAL_ENV.values())
    samples += " Authorization: Bearer " + secrets.token_urlsafe(24)
    samples += " s3://minio:" + secrets.token_hex(8) + "@bucket"
    found = {shape for shape, pattern in TOKEN_SHAPES.items() if re.search(pattern, samples)}
    assert found >= {
        "AWS access key id",
        "Hugging Face token",
        "OpenAI-style key",
        "bearer token",
        "credentials in a URL",
    }
