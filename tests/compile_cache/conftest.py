"""Fixtures for the compile-cache tests: a real S3 API server (moto's server mode) on
127.0.0.1 and a fresh bucket per test; every test gets its own XDG_CONFIG_HOME (so the
user's own signing key is fresh), and S3 tests run as a fleet compile host would, with a
configured signing key. The S3 server and the fleet key are the suite's
(tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(autouse=True)
def own_config_home(tmp_path_factory, monkeypatch) -> None:
    """A private XDG_CONFIG_HOME and XDG_CACHE_HOME (where verified copies of shared
    entries go), inherited by worker processes, and no key settings from the
    environment running the tests."""
    for name in ("VLLM_NEURON_CACHE_SIGNING_KEY", "VLLM_NEURON_CACHE_TRUSTED_KEYS",
                 "VLLM_NEURON_CACHE_ON_UNTRUSTED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))


@pytest.fixture
def s3_bucket(s3_endpoint, fleet_key, monkeypatch, tmp_path) -> str:
    """A fresh bucket on the loopback server; the environment (inherited by worker
    processes) points boto3 at it with throwaway credentials and signs with the fleet
    key, as on a compile host."""
    import boto3

    monkeypatch.setenv("VLLM_NEURON_CACHE_SIGNING_KEY", str(fleet_key))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    bucket = f"compile-cache-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return bucket
