"""End-to-end fixtures: reference backend, a per-session compile cache, the oracle.

An engine takes ~25 s to start on these machines, so tests share one per configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before vLLM is imported so every process vLLM spawns inherits them.
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def compile_cache_dir(tmp_path_factory) -> Path:
    """A fresh compile cache per test session, shared by every engine in it."""
    path = tmp_path_factory.mktemp("compile-cache")
    os.environ["VLLM_NEURON_CACHE_URL"] = str(path)
    return path


@pytest.fixture(scope="session")
def nxdi_python() -> str:
    """An interpreter where NxD Inference and this plugin import (NEURON_TEST_NXDI_PYTHON:
    a Neuron SDK venv, or one built by hand as ../shared/nxdi-cpu/README.md describes);
    the `-m nxdi` tests skip without one."""
    import subprocess

    python = os.environ.get("NEURON_TEST_NXDI_PYTHON")
    if not python:
        pytest.skip("NEURON_TEST_NXDI_PYTHON is not set: no interpreter with NxD Inference")
    probe = subprocess.run(
        [python, "-c", "import neuronx_distributed_inference.models.model_base, "
                       "neuron_plugin.backends.nxd.backend"],
        capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"NxD Inference or the plugin does not import under {python}: {last}")
    return python


@pytest.fixture(scope="session")
def oracles(model_dirs):
    from tests.e2e.support import GreedyOracle

    cache: dict[str, GreedyOracle] = {}

    def get(arch: str) -> GreedyOracle:
        if arch not in cache:
            cache[arch] = GreedyOracle(model_dirs[arch])
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def server(model_dirs, tmp_path_factory):
    """One `vllm serve models/tiny-llama --device neuron` for the whole run (each start
    costs about a minute here), shared by the files in its xdist group "session-server"
    (tests/conftest.py). The platform
    must be chosen by `--device neuron` alone, so VLLM_NEURON_BACKEND is dropped."""
    from tests.e2e.support import Server

    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    server = Server(model_dirs["llama"], tmp_path_factory.mktemp("server") / "serve.log",
                    ["--max-model-len", "512", "--max-num-seqs", "4", "--additional-config",
                     '{"override_neuron_config": {"context_encoding_buckets": [32, 64, 128, 256]}}'],
                    env=env)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused")
