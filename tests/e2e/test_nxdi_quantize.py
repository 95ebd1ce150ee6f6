"""`neuron-plugin quantize` on the nxd backend runs real NxD Inference's own
save_quantized_state_dict (in NxDI's CPU mode, through the runner) and writes exactly the
checkpoint the reference backend's quantizer writes, tensor for tensor, bit for bit:
per channel with modules_to_not_convert, per tensor, and a tied lm_head (Qwen3).

Needs an interpreter where NxD Inference imports (NEURON_TEST_NXDI_PYTHON, see
test_nxdi_cpu_mode.py); skips otherwise."""

from __future__ import annotations

import json
import os

import pytest
from tests.e2e.test_nxdi_cpu_mode import nxdi_python  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.nxdi]

CASES = [
    ("llama", {"quantization_type": "per_channel_symmetric",
               "modules_to_not_convert": ["down_proj"]}),
    ("llama", {"quantization_type": "per_tensor_symmetric"}),
    ("qwen3", {"quantization_type": "per_channel_symmetric"}),
]


@pytest.mark.parametrize("arch,keys", CASES, ids=["per-channel", "per-tensor", "tied-head"])
def test_nxdis_quantizer_writes_what_the_reference_writes(nxdi_python, model_dirs,  # noqa: F811
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
