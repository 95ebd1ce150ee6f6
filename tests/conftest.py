"""Fixtures shared by every test package: the tiny checkpoints (built once), the backend
environment's interpreter, a real S3 API server (moto's) and a fleet signing key."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.environments import environment
from tests.xdist_schedule import pytest_xdist_make_scheduler  # noqa: F401  (the hook)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The deployment build's tests last: their environment installs in the background
    while the others run (scripts/run-tests.sh). Under xdist this only breaks ties:
    the workers take whole files, those with the most tests first (tests/xdist_schedule.py),
    and a deployment test waits for the environment (tests/environments.py)."""
    items.sort(key=lambda item: item.get_closest_marker("deployment") is not None)


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    """Both tiny checkpoints, built once into models/ (idempotent)."""
    from build_tiny_model import build

    return {arch: build(arch, ROOT / "models" / f"tiny-{arch}") for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def tiny_model():
    """arch -> models/tiny-<arch>, for every architecture scripts/build_tiny_model.py
    knows, built on first use (idempotent)."""
    from build_tiny_model import build

    def get(arch: str) -> Path:
        return build(arch, ROOT / "models" / f"tiny-{arch}")

    return get


@pytest.fixture(scope="session")
def speculation_models() -> tuple[Path, Path]:
    """A tiny Mistral and a one-layer draft of it, both trained on the corpus until they
    memorise it (scripts/build_tiny_model.py --train-steps): their continuations of
    corpus text are corpus text and agree, so drafts get accepted (built once)."""
    from build_tiny_model import build_speculation_models

    return build_speculation_models(ROOT / "models")


@pytest.fixture(scope="session")
def eagle_heads() -> tuple[Path, Path, Path]:
    """The speculation target and an EAGLE and an EAGLE-3 head trained on its hidden
    states (scripts/build_eagle_heads.py), so their drafts get accepted (built once)."""
    from build_eagle_heads import build_eagle_heads

    return build_eagle_heads(ROOT / "models")


@pytest.fixture(scope="session")
def lora_adapters(model_dirs) -> dict[str, Path]:
    """PEFT adapters of the tiny Llama (scripts/build_tiny_lora.py ADAPTERS), built once."""
    from build_tiny_lora import build_test_adapters

    return build_test_adapters(model_dirs["llama"], ROOT / "models")


@pytest.fixture(scope="session")
def host_python() -> str:
    """The interpreter of a Neuron host's vLLM environment (the vLLM wheel from the
    index, a CUDA torch build with its torchvision) that scripts/run-tests.sh builds
    with scripts/setup-host-env.sh."""
    python = environment("host", "NEURON_TEST_HOST_PYTHON", "scripts/setup-host-env.sh")
    if python is None:
        pytest.skip("no Neuron host vLLM environment: set NEURON_TEST_HOST_PYTHON "
                    "(scripts/run-tests.sh builds one with scripts/setup-host-env.sh)")
    return python


@pytest.fixture(scope="session")
def sdk_python() -> str:
    """The interpreter of the second environment, with the Neuron SDK's pins (torch 2.9,
    transformers 4.57) and no vLLM, that scripts/run-tests.sh builds for the backend
    runner (scripts/setup-backend-env.sh)."""
    python = environment("sdk", "NEURON_TEST_SDK_PYTHON", "scripts/setup-backend-env.sh")
    default = ROOT / ".venv-sdk" / "bin" / "python"
    if python is None and not os.access(default, os.X_OK):
        pytest.fail(f"no backend environment at {default}: run scripts/setup-backend-env.sh "
                    f"(scripts/run-tests.sh does) or set NEURON_TEST_SDK_PYTHON")
    return python or str(default)


@pytest.fixture(scope="session")
def fleet_key(tmp_path_factory) -> Path:
    """A fleet signing key (private PEM; the public half beside it as .pub)."""
    from compile_cache.signing import generate_key

    path = tmp_path_factory.mktemp("fleet-key") / "fleet.pem"
    generate_key(path)
    return path


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API server (moto's server mode) on a free loopback port."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
