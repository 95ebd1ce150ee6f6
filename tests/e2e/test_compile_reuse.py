"""Compile once, start warm: `neuron-plugin precompile` fills the compile cache, a later
engine with the same configuration compiles nothing, and a changed bucket grid is a miss
whose reason names the bucket field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.support import make_llm, shutdown_llm

pytestmark = pytest.mark.engine

GRID = {"context_encoding_buckets": [32, 64, 256], "token_generation_buckets": [128, 256]}


def _cli(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _logged(capfd, caplog) -> str:
    """What the engine logged since the last call: the engine process's lines on fd 1,
    this process's as records (its vLLM handler may hold the stream of whichever test
    first configured vLLM's logging in this worker)."""
    text = capfd.readouterr().out + caplog.text
    caplog.clear()
    return text


def test_precompile_then_start_warm_and_changed_grid_misses(model_dirs, tmp_path,
                                                            monkeypatch, capfd, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(cache))
    model = model_dirs["llama"]
    flags = [str(model), "--device", "neuron", "--dtype", "float32", "--max-model-len", "256",
             "--max-num-seqs", "4", "--additional-config",
             json.dumps({"override_neuron_config": GRID})]
    # 3 prefill graphs, 2 decode lengths x decode batches 1, 2 and 4 (max_num_seqs 4)
    first = subprocess.run([_cli("neuron-plugin"), "precompile", *flags], capture_output=True,
                           text=True, check=True)
    assert "9 graphs compiled and published" in first.stdout
    again = subprocess.run([_cli("neuron-plugin"), "precompile", *flags], capture_output=True,
                           text=True, check=True)
    assert "9 graphs already in the cache" in again.stdout

    _logged(capfd, caplog)
    shutdown_llm(make_llm(model, additional_config={"override_neuron_config": GRID}))
    warm = _logged(capfd, caplog)
    assert "compiling" not in warm
    assert "compile cache hit: key" in warm

    changed = dict(GRID, context_encoding_buckets=[32, 128, 256])
    shutdown_llm(make_llm(model, additional_config={"override_neuron_config": changed}))
    cold = _logged(capfd, caplog)
    assert "compiling 9 graphs for reference backend" in cold
    miss = next(line for line in cold.splitlines() if "compile cache miss" in line)
    assert "differs in buckets.context_encoding_buckets" in miss

    manifest = tmp_path / "changed.json"
    subprocess.run([_cli("neuron-plugin"), "precompile", *flags[:-1],
                    json.dumps({"override_neuron_config": dict(GRID, token_generation_buckets=[64, 256])}),
                    "--dry-run", str(manifest)], check=True, capture_output=True)
    explained = subprocess.run([_cli("neuron-cache"), "explain", str(manifest), "--json"],
                               capture_output=True, text=True)
    assert explained.returncode == 1  # a miss
    assert "buckets.token_generation_buckets" in explained.stdout
