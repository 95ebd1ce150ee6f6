"""`neuron-plugin validate` end to end on the reference backend, as a user runs it: the
real CLI in a subprocess, vLLM's engine, the backend in the SDK environment's runner
process, the oracle (transformers) in that environment too.

- Every case of the feature matrix passes, across two configurations that between them
  turn every feature on (the block layout with a prefix hit, chunked prefill, a LoRA
  adapter the kit builds and KV blocks moved between two backends; n-gram speculation
  with an int8 checkpoint), the report says what it checked, and a feature this
  configuration could not serve (speculation beside LoRA) is listed as refused.
- A backend that is wrong in one feature (its on-device sampler ignores top-k, injected
  into the backend's process) fails that case by name, exit status 1, while the others
  pass: the kit tells a broken host from a good one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

BUCKETS = [32, 64, 128, 256]
KV = {"kv_connector": "NeuronKVConnector",
      "kv_connector_module_path": "neuron_plugin.kv_transfer.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
# The fault: the backend's on-device sampler draws from global_topk candidates whatever
# the request's top-k (sitecustomize runs before the backend imports its sampler).
FAULT = """
import torch
import neuron_plugin.backends.reference.sampler as sampler

_sample = sampler.sample

def sample(logits, top_k, top_p, temperature, uniform, candidates):
    wrong = torch.where(top_k == 1, top_k, torch.full_like(top_k, candidates))
    return _sample(logits, wrong, top_p, temperature, uniform, candidates)

sampler.sample = sample
"""


def _validate(model: Path, out: Path, args: list[str], env: dict[str, str] | None = None,
              extra: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    config = {"override_neuron_config": {"context_encoding_buckets": BUCKETS}, **(extra or {})}
    command = [str(Path(sys.executable).with_name("neuron-plugin")), "validate", str(model),
               "--device", "neuron", "--dtype", "float32", "--max-model-len", "256",
               "--max-num-seqs", "4", "--quick", "--out", str(out),
               "--additional-config", json.dumps(config), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200,
                          env=env or dict(os.environ))
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else {}
    return done, report


def _statuses(report: dict) -> dict[str, str]:
    return {case["name"]: case["status"] for case in report["cases"]}


def test_every_case_passes_on_the_reference_backend(model_dirs, sdk_python, tmp_path):
    kv = {**KV, "kv_connector_extra_config": {"path": str(tmp_path / "kv")}}
    done, report = _validate(
        model_dirs["llama"], tmp_path / "blocks",
        ["--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens",
         "64", "--enable-lora", "--max-lora-rank", "8", "--kv-transfer-config",
         json.dumps(kv)], extra={"backend_python": sdk_python})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["ok"] and report["backend"] == "reference"
    assert _statuses(report) == {
        "bucket-boundaries": "pass", "first-steps-logprobs": "pass",
        "continuous-batching": "pass", "mixed-step": "pass", "device-sampling": "pass",
        "prefix-cache-hit": "pass", "chunked-prefill": "pass", "lora": "pass",
        "kv-transfer": "pass", "speculation": "refused", "quantized": "not-configured",
        "prompt-logprobs": "not-configured", "images": "not-configured"}
    cases = {case["name"]: case for case in report["cases"]}
    # not turned on, and this configuration could not have it: its LoRA excludes it
    assert "but this backend refuses it" in cases["speculation"]["detail"]
    assert cases["prefix-cache-hit"]["evidence"]["prefix_hit_tokens"] >= \
        cases["prefix-cache-hit"]["evidence"]["shared_tokens"]
    assert cases["kv-transfer"]["evidence"]["blocks_moved"] >= 2
    # the speed section times every compiled graph; no roofline off a Neuron instance
    shapes = {(row["phase"], tuple(row["shape"])) for row in report["speed"]["buckets"]}
    assert ("token_generation", (4, 256)) in shapes
    assert all(row["p50_ms"] > 0 and row["roofline_ms"] is None
               for row in report["speed"]["buckets"])
    assert 0 < report["speed"]["decode_host_share"] < 1
    assert report["versions"]["vllm"].startswith("vLLM 0.32.0")
    assert report["compile_cache_key"]
    markdown = (tmp_path / "blocks" / "report.md").read_text()
    assert markdown.startswith("# neuron-plugin validate: PASS")
    assert "| kv-transfer | pass |" in markdown


def test_speculation_and_quantized_weights_pass(model_dirs, tmp_path):
    from neuron_plugin.tools import cli

    model = model_dirs["llama"]
    quantized = {"quantized": True, "quantized_checkpoints_path": str(tmp_path / "int8"),
                 "quantization_type": "per_channel_symmetric",
                 "context_encoding_buckets": BUCKETS}
    config = json.dumps({"override_neuron_config": quantized})
    env = {**os.environ, "VLLM_NEURON_BACKEND": "reference"}
    assert subprocess.run([str(Path(sys.executable).with_name("neuron-plugin")), "quantize",
                           str(model), "--max-model-len", "256", "--dtype", "float32",
                           "--additional-config", config], env=env, timeout=600,
                          capture_output=True).returncode == 0
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}
    done, report = _validate(model, tmp_path / "spec",
                             ["--speculative-config", json.dumps(spec),
                              "--cases", "bucket-boundaries,speculation,quantized"],
                             extra={"override_neuron_config": quantized})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _statuses(report) == {"bucket-boundaries": "pass", "speculation": "pass",
                                 "quantized": "pass"}
    bound = next(c for c in report["cases"] if c["name"] == "quantized")["evidence"]["bound"]
    assert "argmax agreement" in bound
    assert cli.main(["validate", str(model), "--cases", "nonsense"]) == 2


def test_a_backend_wrong_in_one_feature_fails_that_case(model_dirs, tmp_path):
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAULT)
    env = {**os.environ, "PYTHONPATH": str(fault),
           # graphs compiled with the fault go to a cache of their own
           "VLLM_NEURON_CACHE_URL": str(tmp_path / "cache")}
    done, report = _validate(model_dirs["llama"], tmp_path / "wrong",
                             ["--cases", "device-sampling,bucket-boundaries"], env=env)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert not report["ok"]
    assert _statuses(report) == {"device-sampling": "fail", "bucket-boundaries": "pass"}
    assert "[          fail] device-sampling: the device's draws and the host's differ" \
        in done.stdout
    failing = next(c for c in report["cases"] if c["name"] == "device-sampling")
    # the report carries a device-sampled and a host-sampled request to reproduce it
    assert [("seed" in r["sampling"]) for r in failing["inputs"]] == [False, True]
    assert failing["inputs"][0]["sampling"]["top_k"] == 20
    assert "# neuron-plugin validate: FAIL" in (tmp_path / "wrong" / "report.md").read_text()
