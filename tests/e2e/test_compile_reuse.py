"""A second start with the same configuration loads the compiled graphs instead of
compiling them; a changed bucket grid is a miss whose reason names the bucket field."""

from __future__ import annotations

import pytest
from tests.e2e.support import make_llm, shutdown_llm

pytestmark = pytest.mark.engine

GRID = {"context_encoding_buckets": [32, 64, 256], "token_generation_buckets": [128, 256]}


def _start_and_stop(model_dir, override):
    llm = make_llm(model_dir, additional_config={"override_neuron_config": override})
    shutdown_llm(llm)


def test_second_start_compiles_nothing_and_changed_grid_misses(model_dirs, tmp_path,
                                                               monkeypatch, capfd):
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))

    _start_and_stop(model_dirs["llama"], GRID)
    first = capfd.readouterr().out
    assert "compiling 5 graphs for reference backend" in first
    assert "compile cache miss: no entry for key" in first

    _start_and_stop(model_dirs["llama"], GRID)
    second = capfd.readouterr().out
    assert "compiling" not in second
    assert "compile cache hit: key" in second

    changed = dict(GRID, context_encoding_buckets=[32, 128, 256])
    _start_and_stop(model_dirs["llama"], changed)
    third = capfd.readouterr().out
    assert "compiling 5 graphs" in third
    miss = next(line for line in third.splitlines() if "compile cache miss" in line)
    assert "buckets.context_encoding_buckets" in miss
