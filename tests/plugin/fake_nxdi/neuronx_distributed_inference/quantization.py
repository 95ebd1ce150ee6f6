"""What NxDI's save_quantized_state_dict writes (models/application_base.py ef2731e
747-799, model_base.py 3193-3201 for causal LMs) with neuronx-distributed 0.18's CPU
quantizers (quantization/quantization_utils.py, observer.py, quantization_config.py):

- load_hf_model: the Hugging Face model, float32 (from_pretrained's default); its
  nn.Linear modules are the decoder projections and lm_head (tied to the embedding or
  not), which the double recognises by name;
- per_channel_symmetric (modules_to_not_convert entries kept as substrings of module
  names): int8 scale = max|W[row]| / 127 (PerChannelAbsMaxObserver, quant_max 127), fp8
  scale = max|W[row]| / bound floored at 1e-5, bound 240 for float8_e4m3fn
  (DtypeBound.F8E4M3_MAX), W / scale clamped to the bound; scales float32 [out, 1];
- per_tensor_symmetric (modules_to_not_convert ignored): int8 scale = max|W| / 127.5
  (torch's MinMaxObserver, qint8 symmetric) as float32 [1]; fp8 scale = max|W| / bound,
  a 0-dim tensor in the weights' dtype;
- int8 weights are round(W * (1 / scale)) clamped to [-128, 127] (torch's
  quantize_per_channel / quantize_per_tensor multiply by the float32 inverse);
- any other type raises RuntimeError; the state dict is the model's without its
  `model.` prefix plus `lm_head.*`; None values pruned; written as model.safetensors
  when quantized_checkpoints_path is an existing folder, else torch.save(path).
The double computes these itself; the numbers match neuronx-distributed's (the plugin's
reference quantizer is checked against the real code, tests/e2e/test_nxdi_cpu_mode.py)."""

import os

import torch
from safetensors.torch import load_file, save_file

LINEAR = (".q_proj", ".k_proj", ".v_proj", ".o_proj", ".gate_proj", ".up_proj", ".down_proj")
FP8 = {"f8e4m3": (torch.float8_e4m3fn, 240.0), "f8e4m3fn": (torch.float8_e4m3fn, 240.0),
       "f8e5m2": (torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max))}


def _hf_state_dict(model_path):
    weights = {}
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_path, name)))
    weights = {k: v.float() for k, v in weights.items()}
    if "lm_head.weight" not in weights:  # tie_word_embeddings
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def _quantize(weight, qtype, qdtype):
    if qdtype == "int8":
        eps = torch.finfo(torch.float32).eps
        if qtype == "per_channel_symmetric":
            scale = torch.clamp(weight.abs().amax(dim=1, keepdim=True) / 127.0, min=eps)
        else:
            scale = torch.clamp((weight.abs().amax() / 127.5).reshape(1), min=eps)
        values = torch.round(weight * (1.0 / scale))
        return torch.clamp(values, -128, 127).to(torch.int8), scale
    dtype, bound = FP8[qdtype]
    if qtype == "per_channel_symmetric":
        scale = torch.clamp(weight.abs().amax(dim=1, keepdim=True) / bound, min=1e-5)
        return torch.clamp(weight / scale, -bound, bound).to(dtype), scale.float()
    scale = weight.abs().max() / bound
    return torch.clamp(weight / scale, -bound, bound).to(dtype), scale


def save_quantized_state_dict(model_path, neuron_config):
    qtype = neuron_config.quantization_type
    qdtype = neuron_config.quantization_dtype
    if qtype not in ("per_tensor_symmetric", "per_channel_symmetric"):
        raise RuntimeError(f"{qtype} not supported")
    keep = (neuron_config.modules_to_not_convert or []) if qtype == "per_channel_symmetric" else []
    result = {}
    for name, tensor in _hf_state_dict(model_path).items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and (module.endswith(LINEAR) or module == "lm_head")
        key = name.removeprefix("model.")
        if linear and not any(entry in module for entry in keep):
            result[key], result[key.removesuffix("weight") + "scale"] = _quantize(
                tensor, qtype, qdtype)
        else:
            result[key] = tensor
    path = neuron_config.quantized_checkpoints_path
    if os.path.isdir(path):
        save_file({k: v.contiguous() for k, v in result.items()},
                  os.path.join(path, "model.safetensors"))
    else:
        torch.save(result, path)


def load_quantized_state_dict(path, torch_dtype):
    """checkpoint_loader_fn with quantized (630-683): the weights come from
    quantized_checkpoints_path only; `*.weight_scale` becomes `*.scale`; floating
    tensors but fp8 and scales are cast to torch_dtype (not float32). NxDI reads a
    folder with load_state_dict (safetensors, or .bin via torch.load) and a file with
    torch.load: the double never unpickles and refuses both."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"Quantized checkpoint file not found: {path}")
    if os.path.isfile(path) or any(n.endswith((".bin", ".pt")) for n in os.listdir(path)):
        raise RuntimeError(f"the NxDI double does not unpickle checkpoints ({path})")
    weights = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(path, name)))
    weights = {k.replace(".weight_scale", ".scale"): v for k, v in weights.items()}
    if torch_dtype != torch.float32:
        for name, tensor in list(weights.items()):
            if (torch.is_floating_point(tensor) and tensor.dtype != torch.float8_e4m3fn
                    and not name.endswith("scale")):
                weights[name] = tensor.to(torch_dtype)
    return weights
