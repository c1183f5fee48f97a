"""Fixtures the data-prep tests share."""

from __future__ import annotations

import pytest
from s3_server import moto_s3_server, s3_env


@pytest.fixture
def datasets_bucket(monkeypatch):
    """An S3-compatible server (moto) holding the empty bucket ``datasets``, the environment
    pointing boto3 at it; yields a client of it."""
    boto3 = pytest.importorskip("boto3")
    with moto_s3_server() as endpoint:
        for key, value in s3_env(endpoint).items():
            monkeypatch.setenv(key, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket="datasets")
        yield client
