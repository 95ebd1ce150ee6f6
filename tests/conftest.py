"""Fixtures shared by every test package: the tiny checkpoints (built once)."""

from __future__ import annotations

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
