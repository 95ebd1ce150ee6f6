"""Fixtures shared by every test package: the tiny checkpoints (built once)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    """Both tiny checkpoints, built once into models/ (idempotent)."""
    from build_tiny_model import build

    return {arch: build(arch, ROOT / "models" / f"tiny-{arch}") for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def sdk_python() -> str:
    """The interpreter of the second environment, with the Neuron SDK's pins (torch 2.9,
    transformers 4.57) and no vLLM, that scripts/run-tests.sh builds for the backend
    runner (scripts/setup-backend-env.sh)."""
    python = os.environ.get("NEURON_TEST_SDK_PYTHON", str(ROOT / ".venv-sdk" / "bin" / "python"))
    if not os.access(python, os.X_OK):
        pytest.fail(f"no backend environment at {python}: run scripts/setup-backend-env.sh "
                    f"(scripts/run-tests.sh does) or set NEURON_TEST_SDK_PYTHON")
    return python
