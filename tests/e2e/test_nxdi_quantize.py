"""`neuron-plugin quantize` on the nxd backend runs real NxD Inference's own
save_quantized_state_dict (in NxDI's CPU mode, through the runner) and writes exactly the
checkpoint the reference backend's quantizer writes, tensor for tensor, bit for bit:
per channel with modules_to_not_convert, per tensor, and a tied lm_head (Qwen3). The
tied Qwen3's checkpoint then goes through NxDI's own loading path as on a device
(nxdi_quantized_head_probe.py): its lm_head is the checkpoint's quantized head,
correctly scaled, or the float embedding where modules_to_not_convert keeps it.

Needs an interpreter where NxD Inference imports (NEURON_TEST_NXDI_PYTHON, see
test_nxdi_cpu_mode.py); skips otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nxdi]

CASES = [
    ("llama", {"quantization_type": "per_channel_symmetric",
               "modules_to_not_convert": ["down_proj"]}),
    ("llama", {"quantization_type": "per_tensor_symmetric"}),
    ("qwen3", {"quantization_type": "per_channel_symmetric"}),
]


@pytest.mark.parametrize("arch,keys", CASES, ids=["per-channel", "per-tensor", "tied-head"])
def test_nxdis_quantizer_writes_what_the_reference_writes(nxdi_python, model_dirs,
                                                          tmp_path, monkeypatch, arch, keys):
    import torch
    from safetensors.torch import load_file

    from neuron_plugin.tools import cli

    written = {}
    for backend in ("nxd", "reference"):
        folder = tmp_path / backend
        override = {"quantized": True, "quantized_checkpoints_path": str(folder), **keys,
                    "context_encoding_buckets": [32, 64, 128, 256]}
        extra = {"override_neuron_config": override}
        if backend == "nxd":
            override["on_cpu"] = True  # NxDI's CPU mode: no device needed to quantize
            extra["backend_python"] = nxdi_python
        monkeypatch.setenv("VLLM_NEURON_BACKEND", backend)
        assert cli.main(["quantize", str(model_dirs[arch]), "--max-model-len", "256",
                         "--dtype", "float32", "--additional-config", json.dumps(extra)]) == 0
        assert os.listdir(folder) == ["model.safetensors"]
        written[backend] = load_file(str(folder / "model.safetensors"))
    nxdi, ours = written["nxd"], written["reference"]
    assert sorted(nxdi) == sorted(ours)
    for name, tensor in nxdi.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert nxdi["lm_head.weight"].dtype == torch.int8


PROBE = Path(__file__).with_name("nxdi_quantized_head_probe.py")


@pytest.mark.parametrize("keys", [{"quantization_type": "per_channel_symmetric"},
                                  {"quantization_type": "per_tensor_symmetric"},
                                  {"quantization_type": "per_channel_symmetric",
                                   "modules_to_not_convert": ["lm_head"]}],
                         ids=["per-channel", "per-tensor", "float-head"])
def test_nxdis_loader_takes_a_tied_models_quantized_head(nxdi_python, model_dirs,
                                                         tmp_path, monkeypatch, keys):
    """NxDI's get_state_dict replaces lm_head.weight by the float embedding when the
    config ties them, and neuronx-distributed's cast_weights casts that to the int8
    QuantizedColumnParallel head (every value below 1 becomes 0): measured here with the
    plugin before the fix, the head's output was off by the whole logit. The plugin's
    NxDI config loads the head as written."""
    from neuron_plugin.core.settings import EngineLimits, resolve_settings
    from neuron_plugin.tools import cli

    folder = tmp_path / "q"
    override = {"quantized": True, "quantized_checkpoints_path": str(folder), **keys,
                "context_encoding_buckets": [32, 64, 128, 256], "on_cpu": True}
    monkeypatch.setenv("VLLM_NEURON_BACKEND", "nxd")
    model = model_dirs["qwen3"]
    extra = {"override_neuron_config": override, "backend_python": nxdi_python}
    assert cli.main(["quantize", str(model), "--max-model-len", "256", "--dtype", "float32",
                     "--additional-config", json.dumps(extra)]) == 0
    limits = EngineLimits(max_model_len=256, max_num_seqs=2, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=256, dtype="float32", tp_degree=1)
    settings = resolve_settings(limits, override, backend="nxd",
                                architecture="Qwen3ForCausalLM")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, str(PROBE), json.dumps(settings.to_dict()), str(model)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plugin"] == str(root / "neuron_plugin" / "__init__.py")
    if keys.get("modules_to_not_convert"):
        # NxDI's writer stores the tied head once, as the embedding; its loader copies it
        assert report["written"] == {}
        assert report["loaded_head_dtype"] == "torch.float32"
        assert report["lm_head_module"] == "ColumnParallelLinear"
    else:
        assert report["written"] == {"lm_head.weight": "torch.int8",
                                     "lm_head.scale": "torch.float32"}
        assert report["loaded_head_dtype"] == "torch.int8"
        assert report["lm_head_module"] == "QuantizedColumnParallel"
        assert report["lm_head_weight_dtype"] == "torch.int8"
        assert report["cast_head_equals_written"]
    assert report["max_abs_error"] < 1e-4 * max(1.0, report["max_abs_logit"])
