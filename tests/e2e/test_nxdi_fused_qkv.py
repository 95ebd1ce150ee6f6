"""A float draft of a quantized model with fused_qkv (and a model keeping its attention
float) against NxD Inference's own fused-QKV state-dict conversion on each real release
(nxdi_fused_qkv_probe.py): with the plugin's advised draft list ["layers", "lm_head"]
NxDI raises KeyError on the missing q/k/v scales; completed by the plugin
(backends/nxd/quantized.py complete_for_fused_qkv) it fuses the float weights and
nothing else changes.

Needs NEURON_TEST_NXDI_PYTHONS (tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_fused_qkv_probe.py")
ROOT = Path(__file__).resolve().parents[2]
LAYERS = 3


@pytest.mark.parametrize("keep, kept", [
    (["layers", "lm_head"], range(LAYERS)),  # the advised float draft
    (["self_attn"], range(LAYERS)),  # a model keeping its attention float
    (["layers.1."], [1]),  # one layer kept
])
def test_fused_qkv_with_float_attention_loads_on_nxdi(nxdi_python, keep, kept):
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, str(PROBE), json.dumps(keep), str(LAYERS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    exact = [f"layers.{layer}.self_attn" for layer in kept]
    for module, outcome in report.items():
        assert "KeyError" in outcome["as given"]["error"], module
        completed = outcome["completed"]
        assert completed["modules_to_not_convert"] == [*keep, *exact], module
        fused = [k for k in completed["keys"] if ".Wqkv." in k]
        scales = [f"layers.{n}.self_attn.Wqkv.scale" for n in range(LAYERS) if n not in kept]
        assert sorted(k for k in fused if k.endswith(".scale")) == scales, module
        assert not [k for k in completed["keys"] if "q_proj.weight" in k], module
