"""Run under an interpreter with NxD Inference: a quantized checkpoint written by
`neuron-plugin quantize` taken through the path NxDI and neuronx-distributed load it on
a device, on the CPU. The plugin builds NxDI's application (NxDBackend._new_model); NxDI's
own state-dict path gives the weights (checkpoint_loader_fn); NxDI's
DecoderModelInstance.load_module builds the module it would trace, its linear layers
converted to quantized ones (model_wrapper.py); neuronx-distributed prepares the
checkpoint for it as ModelBuilder.shard_checkpoint does (preprocess_checkpoint, then
cast_weights to each parameter's dtype) and shards it (get_sharded_checkpoint); the
module loads it and its lm_head runs on a random hidden state. Used by
test_nxdi_quantize.py (which resolves the settings: this side has no vLLM); prints one
JSON object.

    python nxdi_quantized_head_probe.py SETTINGS_JSON MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.settings import NeuronSettings
from tests.e2e.nxdi_parallel import model_parallel_of_one


def main(settings_json: str, model_dir: str) -> dict:
    from neuronx_distributed.trace.model_builder import ModelBuilder
    from neuronx_distributed.trace.trace import get_sharded_checkpoint, preprocess_checkpoint

    settings = NeuronSettings.from_dict(json.loads(settings_json))
    backend = NxDBackend(settings, model_dir)
    application = backend._new_model()
    state = application.checkpoint_loader_fn()  # NxDI's own state-dict path
    written = {}
    for name in os.listdir(settings.quantization.checkpoint):
        written.update(load_file(os.path.join(settings.quantization.checkpoint, name)))
    loaded_head = state["lm_head.weight"]
    model_parallel_of_one()
    instance = application.context_encoding_model.get_model_instance()
    instance.load_module()
    module = instance.module
    checkpoint = dict(state)
    preprocess_checkpoint(module, checkpoint)
    object.__new__(ModelBuilder).cast_weights(checkpoint, module, "")  # self is unused
    cast_head = checkpoint["lm_head.weight"]
    get_sharded_checkpoint(checkpoint, module, 0, 1)
    module.load_state_dict(checkpoint, strict=False)
    # what the head should compute: the checkpoint's head dequantized, or the embedding
    # a float head is tied to
    if "lm_head.scale" in written:
        weight = written["lm_head.weight"].float() * written["lm_head.scale"]
    else:
        weight = written.get("lm_head.weight", written["embed_tokens.weight"]).float()
    hidden = torch.randn(1, 3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = module.lm_head(hidden)
    return {
        "plugin": sys.modules["neuron_plugin"].__file__,
        "written": {k: str(v.dtype) for k, v in written.items() if k.startswith("lm_head")},
        "loaded_head_dtype": str(loaded_head.dtype),
        "lm_head_module": type(module.lm_head).__name__,
        "lm_head_weight_dtype": str(module.lm_head.weight.dtype),
        "cast_head_equals_written": "lm_head.weight" in written
        and torch.equal(cast_head, written["lm_head.weight"]),
        "max_abs_error": float((got - hidden @ weight.T).abs().max()),
        "max_abs_logit": float((hidden @ weight.T).abs().max()),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
