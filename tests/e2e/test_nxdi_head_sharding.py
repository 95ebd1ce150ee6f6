"""The plugin's KV-head map (core/kv_heads.py) and the double's
(tests/plugin/fake_nxdi/.../modules/attention/gqa.py) against NxD Inference's own
sharding code on each real release (nxdi_head_sharding_probe.py): strategy, padded
counts and the model head each padded query and KV slot holds, for grouped-query,
multi-query and multi-head models over many TP degrees (8 heads at TP 16 and 16 at TP 32
among them: multi-head models NxDI replicates).

One NxDI behaviour shows here: a grouped-query model converted to multi-head attention
(TP no multiple of its KV heads, e.g. Llama-3-8B at TP 12) has its K/V replicated and
then padded at the tail from the replicated size (gqa.py _maybe_pad_tail, 0.9 lines
203-214), so the hook returns `repeats` times the padded KV heads; the slots the ranks
load are the first padded_kv_heads ones, which are compared.

Needs NEURON_TEST_NXDI_PYTHONS (tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from neuron_plugin.core.kv_heads import head_sharding

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_head_sharding_probe.py")
ROOT = Path(__file__).resolve().parents[2]
DOUBLE = ROOT / "tests/plugin/fake_nxdi/neuronx_distributed_inference/modules/attention/gqa.py"
HEADS = (1, 2, 3, 4, 6, 8, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96, 128)
TP_DEGREES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
CASES = [(heads, kv, tp) for heads in HEADS for kv in range(1, heads + 1) if heads % kv == 0
         for tp in TP_DEGREES]


def _double():
    spec = importlib.util.spec_from_file_location("fake_nxdi_gqa", DOUBLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_head_map_equals_nxdis(nxdi_python):
    assert {(8, 8, 16), (16, 16, 32), (32, 8, 12), (28, 4, 32)} <= set(CASES)
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, str(PROBE), json.dumps(CASES)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(real) == len(CASES) > 1000
    double = _double()
    for case in real:
        heads, kv, tp = case["heads"], case["kv_heads"], case["tp"]
        where = (heads, kv, tp)
        ours = head_sharding(tp, heads, kv)
        padded_kv = case["padded_kv_heads"]
        assert (ours.strategy, ours.padded_attention_heads, ours.padded_kv_heads) == (
            case["strategy"], case["padded_heads"], padded_kv), where
        loaded = case["kv_slots"][:padded_kv]
        assert list(ours.slot_heads) == loaded == case["v_slots"][:padded_kv], where
        assert double.preshard_head_slots(tp, heads, kv) == (case["q_slots"], loaded), where
        replicated_then_padded = case["strategy"] == "convert-to-mha" and padded_kv != kv != heads
        overshoot = heads // kv if replicated_then_padded else 1
        assert len(case["kv_slots"]) == padded_kv * overshoot, where
