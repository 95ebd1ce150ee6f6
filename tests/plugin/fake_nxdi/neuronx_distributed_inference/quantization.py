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
  when quantized_checkpoints_path is an existing folder (one name of tensors that share
  memory, see _without_shared), else torch.save(path).
The double computes these itself; the numbers match neuronx-distributed's (the plugin's
reference quantizer is checked against the real code, tests/e2e/test_nxdi_quantize.py).
What a device then loads from it: cast_to_parameters."""

import os
import warnings

import torch
from safetensors.torch import load_file, save_file

LINEAR = (".q_proj", ".k_proj", ".v_proj", ".Wqkv", ".o_proj", ".gate_proj", ".up_proj",
          ".down_proj")
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


def _without_shared(state_dict):
    """save_state_dict_safetensors (modules/checkpoint.py) is huggingface_hub's
    save_torch_state_dict, which keeps one name of tensors sharing memory, the first in
    sorted order (serialization/_torch.py _remove_duplicate_names): a tied lm_head left
    unquantized is stored as embed_tokens.weight alone."""
    kept = {}
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if all(tensor.data_ptr() != other.data_ptr() for other in kept.values()):
            kept[name] = tensor
    return kept


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
        save_file({k: v.contiguous() for k, v in _without_shared(result).items()},
                  os.path.join(path, "model.safetensors"))
    else:
        torch.save(result, path)


QUANTIZED_DTYPES = {"int8": torch.int8, **{name: dtype for name, (dtype, _) in FP8.items()}}


def _traced_path(module):
    """The path of a checkpoint's module (`layers.0.self_attn.q_proj`) in NxDI's traced
    decoder, where convert matches modules_to_not_convert: the attention's projections
    live in its GroupQueryAttention_QKV (`qkv_proj`, holding q_proj, k_proj and v_proj)
    and GroupQueryAttention_O (`o_proj`, holding o_proj), or with fused_qkv its one Wqkv
    (attention_base.py ef2731e lines 412-413, gqa.py lines 410-482 and 998-1016)."""
    for projection in ("q_proj", "k_proj", "v_proj", "Wqkv"):
        if module.endswith(f".self_attn.{projection}"):
            return module.removesuffix(projection) + f"qkv_proj.{projection}"
    if module.endswith(".self_attn.o_proj"):
        return module + ".o_proj"
    return module


def _converted(module, modules_to_not_convert):
    """Whether neuronx-distributed's quantize.convert turns `module` (a checkpoint's
    module path of the decoder) into a quantized layer: the decoder's linear layers and
    lm_head, unless an entry of modules_to_not_convert is a substring of its traced path
    (_convert_initialized_float_to_initialized_quantized, quantize.py 0.18 lines
    93-125; _traced_path)."""
    linear = module.endswith(LINEAR) or module == "lm_head"
    path = _traced_path(module)
    return linear and not any(entry in path for entry in modules_to_not_convert or [])


def cast_to_parameters(weights, app):
    """What the device's parameters receive from the checkpoint: neuronx-distributed's
    ModelBuilder.cast_weights (trace/model_builder.py 0.18 lines 801-815, run by
    shard_checkpoint before sharding) casts every tensor to its parameter's dtype. With
    `quantized` the traced decoders' converted layers (model_wrapper.py
    DecoderModelInstance.load_module, ef2731e lines 1477-1528; with fused speculation
    the draft and the target, each with its own config's modules_to_not_convert) hold
    their weight in quantization_dtype, so a float tensor loaded there (a tied
    embedding, a float draft) is cast to it: int8 truncates, every value below 1 in
    magnitude becomes 0 (NxD only warns). A converted layer whose scale the checkpoint
    lacks gets none (shard_children skips what the checkpoint lacks, trace.py lines
    765-775). Either way its decoder's prefix is listed in app.garbled: the double's
    graphs then answer garbage for it."""
    app.garbled = set()
    target = app.neuron_config
    if not target.quantized:
        return weights
    decoders = {"": target}
    if target.enable_fused_speculation:
        decoders = {"draft_model.": app.fused_spec_config.draft_config.neuron_config,
                    "target_model.": target}
    dtype = QUANTIZED_DTYPES[target.quantization_dtype]
    for prefix, config in decoders.items():
        for name in [n for n in weights if n.startswith(prefix) and n.endswith(".weight")]:
            module = name[len(prefix):].removesuffix(".weight")
            if not _converted(module, config.modules_to_not_convert):
                continue
            if weights[name].dtype != dtype:
                warnings.warn(f"casting {name} from {weights[name].dtype} to {dtype}")
                weights[name] = weights[name].to(dtype)
                app.garbled.add(prefix)
            if f"{prefix}{module}.scale" not in weights:
                app.garbled.add(prefix)
    return weights
