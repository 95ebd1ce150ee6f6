"""Run under an interpreter with NxD Inference: NxDI's own fused-QKV state-dict conversion
(convert_state_dict_to_fused_qkv of modeling_llama.py and modeling_qwen2.py) on a
quantized model's config whose modules_to_not_convert keeps some layers' attention
float, as given and as the plugin completes it (backends/nxd/quantized.py
complete_for_fused_qkv). A kept layer's q/k/v have no scales, as NxDI's writer stores
them. Prints one JSON object: per module and list, the error NxDI raised or the fused
keys it produced.

    python nxdi_fused_qkv_probe.py '["layers", "lm_head"]' LAYERS
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import torch

from neuron_plugin.backends.nxd.nxdi import import_nxdi
from neuron_plugin.backends.nxd.quantized import complete_for_fused_qkv


def state_dict(keep: list[str], layers: int) -> dict[str, torch.Tensor]:
    """q/k/v weights and biases (Qwen2 has them) of every layer, scales where `keep`
    leaves the layer quantized."""
    tensors = {}
    for layer in range(layers):
        for p in ("q_proj", "k_proj", "v_proj"):
            name = f"layers.{layer}.self_attn.{p}"
            tensors[f"{name}.weight"] = torch.ones(2, 2)
            tensors[f"{name}.bias"] = torch.ones(2)
            if not any(entry in f"layers.{layer}.self_attn.qkv_proj.Wqkv" for entry in keep):
                tensors[f"{name}.scale"] = torch.ones(2, 1)
    return tensors


def run(convert, keep: list[str], layers: int, complete: bool) -> dict:
    neuron_config = SimpleNamespace(fused_qkv=True, quantized=True,
                                    quantized_mlp_kernel_enabled=False,
                                    modules_to_not_convert=list(keep))
    if complete:
        complete_for_fused_qkv(neuron_config, layers, "modules_to_not_convert")
    config = SimpleNamespace(neuron_config=neuron_config, num_hidden_layers=layers)
    try:
        fused = convert(copy.deepcopy(state_dict(keep, layers)), config)
    except KeyError as err:
        return {"error": f"KeyError: {err}"}
    return {"keys": sorted(fused), "modules_to_not_convert": neuron_config.modules_to_not_convert}


def main(keep: list[str], layers: int) -> dict:
    import_nxdi()
    from neuronx_distributed_inference.models.llama import modeling_llama
    from neuronx_distributed_inference.models.qwen2 import modeling_qwen2

    return {module.__name__.rsplit(".", 1)[-1]: {
        kind: run(module.convert_state_dict_to_fused_qkv, keep, layers, kind == "completed")
        for kind in ("as given", "completed")} for module in (modeling_llama, modeling_qwen2)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), int(sys.argv[2]))))
