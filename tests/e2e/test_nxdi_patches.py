"""The plugin's NxDI patches on each real NxD Inference release (nxdi_patches_probe.py):
every probe finds exactly the defects that release has (what the double reproduces per
release, tests/plugin/test_patches.py), and the fixes whose code runs outside a model
work on NxDI's own code: a context as long as a bucket takes that bucket, and the
on-device nucleus is vLLM's (vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p, the
oracle); a Qwen3-VL image-padding position past the target lands in the scratch row;
NxDI 0.8's image-to-text forward finds its tensor_capture_hook; Qwen2-VL's rotary
embedding gives each M-RoPE section its own position row, and its text wrapper traces
them. prefix-prefill-mask and
cpu-captured-offset are proven through the backend
(test_nxdi_architectures.py: every prefix-cache hit; every CPU forward on 0.8), the
gemma3 patches by Gemma3 on each release (0.8's module, which it ships unlisted, has
three of 0.9's four defects and two of its own: gemma3-scale, and gemma3-cpu-norm in
NxDI's CPU mode, which this probe runs in).

Needs NEURON_TEST_NXDI_PYTHONS (tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.e2e.conftest import nxdi_release

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_patches_probe.py")
ROOT = Path(__file__).resolve().parents[2]
LOGITS = [math.log(p) for p in (0.35, 0.25, 0.2, 0.12, 0.05, 0.03)]
TOP_PS = [0.5, 0.7, 0.8, 0.9, 0.95]
EVERY_RELEASE = {"adapter-prefix-lens", "cte-exact-bucket", "prefix-prefill-mask",
                 "sampler-top-p", "vision-scatter-scratch-row", "qwen2-vl-mrope",
                 "llama4-rope-temperature"}
GEMMA3 = {"gemma3-config", "gemma3-rope", "gemma3-window", "gemma3-norms"}
GEMMA3_0_8 = {"gemma3-config", "gemma3-rope", "gemma3-window", "gemma3-scale",
              "gemma3-cpu-norm"}
# release -> the defects found in its source (docs/serving/nxdi-patches.md); ef2731e, the
# 0.9 checked, has the adapter's tensor_capture_hook fixed.
DEFECTS = {
    (0, 8): {"adapter-forward-kwargs", "cpu-captured-offset", "i2t-capture-hook",
             *EVERY_RELEASE, *GEMMA3_0_8},
    (0, 9): EVERY_RELEASE | GEMMA3,
}


def test_patches_on_real_nxdi(nxdi_python):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    release = nxdi_release(nxdi_python)
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, str(PROBE), json.dumps(LOGITS), json.dumps(TOP_PS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    applied = {name for name, status in report["status"].items() if status == "applied"}
    assert applied == DEFECTS[release], report["status"]
    assert report["cte_bucket"] == 2
    # the padding entry lands in the scratch row, position 1 keeps its zeros
    assert report["scattered"] == [[[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]]
    assert report["capture_hook_resolves"]
    # section i rotated by position row i: the angles of row i's positions
    assert report["mrope_sections_equal_one_row_each"] == [True, True, True]
    assert report["traced_rotary_shapes"] == [[3, 1, 4], [3, 1, 8], [3, 2, 1]]
    logits = torch.tensor(LOGITS)
    for top_p, nucleus in zip(TOP_PS, report["nuclei"], strict=True):
        expected = torch.softmax(apply_top_k_top_p(logits[None, :].clone(), None,
                                                   torch.tensor([top_p])), -1)[0]
        assert torch.allclose(torch.tensor(nucleus), expected, atol=1e-6), top_p
