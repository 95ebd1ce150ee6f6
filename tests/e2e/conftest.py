"""End-to-end fixtures: reference backend, a per-session compile cache, the oracle.

An engine takes ~25 s to start on these machines, so tests share one per configuration.
"""

from __future__ import annotations

import functools
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


NXDI_PYTHONS = "NEURON_TEST_NXDI_PYTHONS"


@functools.cache
def nxdi_interpreters() -> dict[str, tuple[str, str] | None]:
    """Test id -> (interpreter, NxDI version) where NxD Inference imports, one per
    release to check (NEURON_TEST_NXDI_PYTHONS, os.pathsep-separated, e.g. the NxDI 0.8
    and 0.9 environments ../shared/nxdi-cpu/README.md builds; NEURON_TEST_NXDI_PYTHON
    names one). The id names the release ("nxdi-0.8"), so every `-m nxdi` case runs once
    per release; without any: {"no-nxdi": None} (the tests skip)."""
    import subprocess

    listed = os.environ.get(NXDI_PYTHONS) or os.environ.get("NEURON_TEST_NXDI_PYTHON") or ""
    found: dict[str, tuple[str, str] | None] = {}
    for python in filter(None, listed.split(os.pathsep)):
        probe = subprocess.run(
            [python, "-c", "import importlib.metadata as m; "
                           "print(m.version('neuronx-distributed-inference'))"],
            capture_output=True, text=True, timeout=120)
        version = probe.stdout.strip() if probe.returncode == 0 else "unknown"
        test_id = "nxdi-" + ".".join(version.split("+")[0].split(".")[:2])
        while test_id in found:
            test_id += "+"
        found[test_id] = (python, version)
    return found or {"no-nxdi": None}


def nxdi_release(python: str) -> tuple[int, int]:
    """The (major, minor) NxD Inference release of an interpreter of nxdi_interpreters."""
    version = next(v[1] for v in nxdi_interpreters().values() if v and v[0] == python)
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test that needs NxD Inference runs once per release listed (see
    nxdi_interpreters)."""
    if "nxdi_python" in metafunc.fixturenames:
        interpreters = nxdi_interpreters()
        metafunc.parametrize("nxdi_python", [v and v[0] for v in interpreters.values()],
                             indirect=True, ids=list(interpreters), scope="session")


@pytest.fixture(scope="session")
def nxdi_python(request, tmp_path_factory) -> str:
    """An interpreter where NxD Inference and this plugin import (one per release, see
    nxdi_interpreters); the `-m nxdi` tests skip without one. The processes started
    after it get a TMPDIR under pytest's own folders, which pytest prunes: the NxDI
    probes compile into `tempfile.mkdtemp()` folders, one per case, that were left in
    /tmp (hundreds over a few runs)."""
    import subprocess

    python = request.param
    if not python:
        pytest.skip(f"{NXDI_PYTHONS} is not set: no interpreter with NxD Inference")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("nxdi-tmp"))
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
    costs about a minute here), shared by the files that tests/xdist_schedule.py runs on
    one worker. The platform must be chosen by `--device neuron` alone, so
    VLLM_NEURON_BACKEND is dropped."""
    from tests.e2e.support import Server

    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    # Without OMP_NUM_THREADS, as users serve: each process sets its torch threads by the
    # serving rule (core.threads), the engine's to this test worker's share of the cores.
    threads = env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["VLLM_NEURON_TORCH_THREADS"] = threads
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
