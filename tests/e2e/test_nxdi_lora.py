"""The nxd backend's LoRA slots on real NxD Inference 0.9's LoraModelManager
(nxdi_lora_probe.py: NxDI's own run-time adapter loading and its context-encoding swap
into device weights, up to the graph, which NxDI's CPU mode cannot run with LoRA):
- a name loaded again from another folder under a new lora_int_id (vLLM after
  /v1/unload_lora_adapter) serves its new weights, the old adapter in its slot its old
  ones: NxDI keys its caches by name and never reloads a name it holds;
- an adapter NxDI fails to read raises AdapterError naming it, leaves its slot empty
  (the base model) and NxDI's CPU cache without it; the other slot serves on and the
  next adapter into the slot loads.

On NxDI 0.8 (inf2/trn1), which loads no adapter at run time: the adapters given at start
(lora_ckpt_paths) serve from the weights NxDI loaded, rows without one read a zero slot,
and any other adapter is refused naming why.

Needs an interpreter where NxD Inference imports (NEURON_TEST_NXDI_PYTHONS, see
tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests.e2e.conftest import nxdi_release

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_lora_probe.py")


def test_real_nxdi_adapter_identity_and_failed_loads(nxdi_python, model_dirs,
                                                     lora_adapters):
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    limits = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=256, dtype="float32", tp_degree=1,
                          max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    adapters = {n: str(lora_adapters[f"lora-{n}"]) for n in "abc"}
    start_only = nxdi_release(nxdi_python) < (0, 9)
    override: dict = {"context_encoding_buckets": [32, 64, 128, 256]}
    if start_only:
        override["lora_config"] = {"lora_ckpt_paths": {"a": adapters["a"]}}
    settings = resolve_settings(limits, override, backend="nxd",
                                architecture="LlamaForCausalLM")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NXD_CPU_MODE": "1", "NEURON_RT_VISIBLE_CORES": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, str(PROBE), json.dumps(settings.to_dict()),
                           str(model_dirs["llama"]), json.dumps(adapters)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plugin"] == str(root / "neuron_plugin" / "__init__.py")
    if start_only:
        assert report["loading"]["at_run_time"] is False
        assert "cannot load adapters at run time" in report["loading"]["why"]
        assert report["start_adapter_loaded"] and report["base_slot_zero"]
        assert report["index"] != report["base"]
        assert "LoRA adapter 'z'" in report["error"]
        assert "serves only those given at start (a=" in report["error"]
        return
    assert report["reused_name_new_weights"] and report["first_still_served"]
    assert "'g' (id 3)" in report["error"] and "FileNotFoundError" in report["error"]
    assert report["slot_1_after_failure"] == 0  # NxDI's zero base adapter
    names = report["names"]
    assert report["cpu_cache_after_failure"] == sorted([0, names["x@2"]])
    assert report["slot_2_still_served"] and report["slot_1_reloaded"]
