"""`neuron-plugin validate` on real NxD Inference in NxDI's CPU mode (the backend and the
oracle both in NEURON_TEST_NXDI_PYTHON's environment): the tiny Llama in the block layout
with a prefix-cache hit and the tiny Qwen3 in the contiguous layout pass every case they
turn on, and list what the CPU mode would refuse (LoRA) as refused; asked for such a
feature, validate stops before the engine starts, naming why. Skipped without such an interpreter (CI has none: NxDI is not on the package index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.server, pytest.mark.nxdi]

OVERRIDE = {"on_cpu": True, "context_encoding_buckets": [32, 64, 128, 256],
            "token_generation_buckets": [64, 128, 256]}


def _validate(python: str, model: Path, out: Path, args: list[str]):
    env = {**os.environ, "VLLM_NEURON_BACKEND": "nxd", "VLLM_NEURON_BACKEND_PYTHON": python}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("neuron-plugin")), "validate", str(model),
         "--device", "neuron", "--dtype", "float32", "--max-model-len", "256",
         "--max-num-seqs", "4", "--quick", "--out", str(out), "--additional-config",
         json.dumps({"override_neuron_config": OVERRIDE}), *args],
        capture_output=True, text=True, timeout=1800, env=env)
    return done


@pytest.mark.parametrize("arch,args,expected", [
    ("llama", ["--enable-prefix-caching", "--block-size", "32"],
     {"prefix-cache-hit": "pass"}),
    ("qwen3", [], {"prefix-cache-hit": "not-configured"}),
])
def test_validate_passes_on_real_nxdi(nxdi_python, model_dirs, tmp_path, arch, args,
                                      expected):
    done = _validate(nxdi_python, model_dirs[arch], tmp_path / arch, args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / arch / "report.json").read_text())
    statuses = {c["name"]: c["status"] for c in report["cases"]}
    for case in ("bucket-boundaries", "first-steps-logprobs", "continuous-batching",
                 "mixed-step", "device-sampling"):
        assert statuses[case] == "pass", (case, report["cases"])
    assert {k: statuses[k] for k in expected} == expected
    # not turned on, and what the CPU mode would refuse if it were: listed as refused
    lora = next(c for c in report["cases"] if c["name"] == "lora")
    assert lora["status"] == "refused" and "NxDI's CPU mode) cannot run --enable-lora" \
        in lora["detail"]
    assert report["backend"] == "nxd"
    assert report["versions"]["neuronx-distributed-inference"].startswith("0.")


def test_what_the_cpu_mode_cannot_run_is_refused_naming_why(nxdi_python, model_dirs,
                                                            tmp_path):
    done = _validate(nxdi_python, model_dirs["llama"], tmp_path / "lora",
                     ["--enable-lora", "--max-lora-rank", "8"])
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "on_cpu=true (NxDI's CPU mode) cannot run --enable-lora" in done.stdout + done.stderr
