"""Sharded models on real NxD Inference: the plugin's NxD backend at tensor parallelism 2
in NxDI's CPU mode, one process per rank under torchrun (what `to_cpu()` needs), against
transformers, in both KV layouts. What this checks beyond tests/e2e/test_nxdi_architectures.py
(TP 1) is the sharding: the plugin's own Gemma 4 class (column/row-parallel projections,
its KV heads split over ranks, the MoE form's experts; Qwen3.5's, dense and MoE, its
DeltaNet heads, channels and per-sequence state split over ranks, in the contiguous
layout, which it alone serves, with a state model's continuous-batching, long and
repeated-token cases) and the Gemma3 module 0.8 ships
unlisted with the plugin's patches, beside NxDI's Llama class as a control. The logits
come from the logits graphs, which gather every rank's vocabulary shard; NxDI's CPU
sampler takes each rank's own shard, so the backend refuses `run` in this mode
(core.nxdi_cpu_mode.sharded_sampler_problem) and the probe reads greedy tokens from the
logits. Host sampling at TP 2 on these 977-token vocabularies is refused
(compat._padded_vocabulary_problems: NxDI masks real tokens of gathered logits).

Needs NEURON_TEST_NXDI_PYTHONS (tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import nxdi_release
from tests.e2e.support import GreedyOracle
from tests.e2e.test_nxdi_architectures import (
    PREFIX,
    PROBE,
    STATE_ARCHS,
    STEPS,
    expect_equal,
    expect_prefix_hit,
    nxd_settings,
    probe_prompts,
    refused_as_expected,
)

pytestmark = [pytest.mark.nxdi]

TP = 2
ARCHS = ["llama", "gemma3", "gemma4", "gemma4_moe", "qwen3_5", "qwen3_5_moe"]
ROOT = Path(__file__).resolve().parents[2]
HOST_SAMPLING = {"on_device_sampling_config": None}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module", params=ARCHS)
def sharded(request, nxdi_python, tiny_model, tmp_path_factory):
    """(arch, prompts, rank 0's report, its logits folder, the oracle, release) per arch,
    the probe run by torchrun with one process per rank."""
    arch = request.param
    model_dir = tiny_model(arch)
    config = json.loads((model_dir / "config.json").read_text())
    name = config["architectures"][0]
    state = arch in STATE_ARCHS
    prompts = probe_prompts(model_dir, config, state)
    out = tmp_path_factory.mktemp(f"nxdi-tp{TP}-{arch}")
    # the settings are resolved as each rank's process would see them (under torchrun)
    os.environ["WORLD_SIZE"] = str(TP)
    try:
        layouts = {"contiguous": nxd_settings(name, False, TP),
                   "block": nxd_settings(name, True, TP),
                   "host_sampling": nxd_settings(name, False, TP, HOST_SAMPLING)}
    finally:
        del os.environ["WORLD_SIZE"]
    torchrun = str(Path(nxdi_python).with_name("torchrun"))
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    report = {}
    # one torchrun per layout: under torchrun to_cpu() starts the process group whenever
    # WORLD_SIZE is set, so a second model in the process fails (application_base.py)
    for layout, settings in layouts.items():
        plan = {"model": str(model_dir), "steps": STEPS, "prefix": PREFIX,
                "prompts": prompts, "layouts": {layout: settings}, "staggered": state}
        (out / f"plan-{layout}.json").write_text(json.dumps(plan))
        done = subprocess.run(
            [torchrun, f"--nproc-per-node={TP}", f"--master-port={_free_port()}", str(PROBE),
             str(out / f"plan-{layout}.json"), str(out)],
            capture_output=True, text=True, timeout=1800, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        report.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return (arch, prompts, report, out / "rank0", GreedyOracle(model_dir),
            nxdi_release(nxdi_python))


@pytest.mark.parametrize("layout", ["contiguous", "block"])
def test_sharded_model_equals_transformers(sharded, layout):
    if refused_as_expected(sharded, layout):
        return
    report = sharded[2]
    assert "device_sampling" not in report[layout]  # the CPU mode's sampler is refused
    expect_equal(sharded, layout, "batch1", ["a"])
    expect_equal(sharded, layout, "batch2", ["a", "b"])


def test_sharded_prefix_cache_hit_reads_the_cached_prefix(sharded):
    if refused_as_expected(sharded, "block"):
        pytest.skip("the block layout is refused")
    expect_prefix_hit(sharded)


def test_sharded_state_model_continuous_batching_and_long_prompt(sharded):
    """Each core's share of the DeltaNet state: b prefilled while a decodes, both decoded
    together, four chunks, one token repeated."""
    if sharded[0] not in STATE_ARCHS:
        pytest.skip("a model without per-sequence state")
    for case, rows in (("staggered", ["a", "b"]), ("long", ["c"]), ("repeated", ["r"])):
        expect_equal(sharded, "contiguous", case, rows)


def test_host_sampling_that_would_hide_real_tokens_is_refused(sharded):
    refused = sharded[2]["host_sampling"]["refused"]
    assert "--tensor-parallel-size 2 with a vocabulary of 977" in refused
    assert "so token 976 could never be sampled" in refused
