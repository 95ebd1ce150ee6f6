"""A quantized checkpoint (core.quantization) as NxDI loads it onto NeuronCores.

On a device NxDI traces every linear layer not in modules_to_not_convert as a
quantized layer (model_wrapper.py DecoderModelInstance.load_module, ef2731e lines
1477-1528, neuronx-distributed quantize.convert), reads the weights from
quantized_checkpoints_path (application_base.py checkpoint_loader_fn, lines 630-683),
and neuronx-distributed casts each loaded tensor to its parameter's dtype, with a
warning only (trace/model_builder.py ModelBuilder.cast_weights, 0.18 lines 801-815).
Two things follow.

- **A tied lm_head.** NxDI's own writer quantizes lm_head even when the model ties it
  to the embedding (the Hugging Face model's lm_head is then the embedding,
  model_base.py prepare_quantized_state_dict, lines 3193-3201): the checkpoint holds
  `lm_head.weight` int8 and `lm_head.scale`. But NxDI's loader replaces `lm_head.weight`
  with the float `embed_tokens.weight` whenever the config sets tie_word_embeddings
  (application_base.py get_state_dict, lines 731-732, and each model's
  update_state_dict_for_tied_weights; 0.7 and 0.8 alike), and the cast to the int8
  parameter truncates it: embedding values below 1 in magnitude become 0, scaled by the
  int8 head's scale. Garbage, silently (Llama-3.2-1B/3B, small Qwen2.5/Qwen3, Gemma3).
  So when lm_head is quantized the plugin clears tie_word_embeddings on NxDI's config
  (read nowhere else in NxDI's decoders) and NxDI loads the head the checkpoint holds,
  int8 with its scale, which is what the reference backend serves from the same
  checkpoint; a checkpoint without it is refused, naming the tie. Where
  modules_to_not_convert keeps lm_head in the model dtype the tie stays: NxDI's writer
  then stores the embedding once (huggingface_hub's save_torch_state_dict drops the
  shared `lm_head.weight`) and its loader copies it into the float head, as it should.
- **A fused draft model.** NxDI converts the draft's layers as well as the target's
  (load_module converts `draft_model` and `target_model`, each with its own config's
  modules_to_not_convert, lines 1512-1522) but loads the draft from its own float
  folder, which has no scales (checkpoint_loader_fn): a load failure or a garbage draft
  that never proposes an accepted token. The draft's config is a copy of the target's
  whose modules_to_not_convert is `draft_model_modules_to_not_convert` where given
  (nxd.neuron_config.draft_neuron_config, as vllm-neuron and NxDI's inference_demo
  build it): where that list keeps every linear layer of the draft in float, NxDI
  converts none of them and the float draft loads as it is. That is accepted; any
  other draft with quantized weights is refused, naming the layers NxDI would convert.
  neuronx-distributed matches the entries as substrings of the traced module's path
  (quantize.py `_convert_initialized_float_to_initialized_quantized`, 0.18 lines
  93-125), which is NxDI's path, not the checkpoint's: the attention projections sit
  in `qkv_proj` (`GroupQueryAttention_QKV`'s q_proj/k_proj/v_proj, or one fused Wqkv)
  and `o_proj` (`GroupQueryAttention_O`'s o_proj) (attention_base.py lines 412-413,
  gqa.py lines 411-482 and 998-1016), so "self_attn.q_proj" keeps nothing there;
  `nxdi_module_paths` gives those paths.
- **Fused QKV.** With `fused_qkv` NxDI concatenates each layer's q/k/v weights into Wqkv
  when it reads a state dict, and their scales too unless the exact entry
  `layers.{l}.self_attn` is in modules_to_not_convert (`convert_state_dict_to_fused_qkv`:
  modeling_llama.py 0.9 lines 191-205, 0.8 242-256; the same test in qwen2's and
  gpt_oss's), a list lookup, not the substring match the conversion itself uses. So a
  layer whose attention a broader entry keeps float ("layers", "self_attn": a float
  draft as advised below, or a target keeping its attention) has no scales to
  concatenate: KeyError at load. `complete_for_fused_qkv` adds the exact entry for every
  such layer, which keeps nothing more in float, and refuses a layer whose q/k/v are kept
  but whose o_proj is not (the exact entry would keep o_proj as well).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import safetensors_header, safetensors_shapes
from neuron_plugin.core.quantization import Quantization, linear_modules
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names


def untie_quantized_head(config: Any, settings: NeuronSettings) -> bool:
    """Before NxDI builds the application from its InferenceConfig `config`: with
    quantized weights NxDI loads lm_head from the checkpoint, not from the embedding
    (module docstring). Whether it untied them (check_quantized_head then checks the
    checkpoint's head)."""
    quantization = settings.quantization
    if quantization is None or not quantization.converts("lm_head"):
        return False
    tied = bool(getattr(config, "tie_word_embeddings", False))
    config.tie_word_embeddings = False
    return tied


def check_quantized_head(quantization: Quantization, folder: Path, model: str) -> None:
    """Refuse, naming the tie, a quantized checkpoint of a tied model (untied by
    untie_quantized_head) without its quantized lm_head."""
    header = safetensors_header(folder)
    weight, scale = header.get("lm_head.weight"), header.get("lm_head.scale")
    if weight is None:
        problem = "no lm_head.weight"
    elif weight.get("dtype") in FLOAT_DTYPES:
        problem = f"a {weight['dtype']} lm_head.weight, not a {quantization.dtype} one"
    elif scale is None:
        problem = "no lm_head.scale"
    else:
        return
    raise NeuronConfigError(
        f"override_neuron_config.quantized_checkpoints_path={str(folder)!r} holds "
        f"{problem}, and the model ties lm_head to embed_tokens (tie_word_embeddings): "
        f"NxDI would put the float embedding into the {quantization.dtype} lm_head, "
        f"which neuronx-distributed casts to {quantization.dtype} (every value below 1 "
        f"becomes 0): wrong tokens. Rewrite the checkpoint with `neuron-plugin quantize "
        f"{model} [the serve flags you use]`, which writes the quantized head."
    )


def nxdi_module_paths(module: str) -> tuple[str, ...]:
    """The paths NxDI's traced decoder gives a checkpoint's linear module (module
    docstring): `model.` dropped, the attention projections inside their GQA modules
    (q/k/v_proj separate or fused into Wqkv, with fused_qkv)."""
    path = module.removeprefix("model.")
    for projection in ("q_proj", "k_proj", "v_proj"):
        suffix = f".self_attn.{projection}"
        if path.endswith(suffix):
            attention = path.removesuffix(f".{projection}")
            return (f"{attention}.qkv_proj.{projection}", f"{attention}.qkv_proj.Wqkv")
    if path.endswith(".self_attn.o_proj"):
        return (f"{path}.o_proj",)
    return (path,)


def converted_draft_modules(shapes: Mapping[str, Sequence[int]], keep: Sequence[str]) -> list[str]:
    """The draft's linear modules (checkpoint paths) NxDI converts to quantized layers
    under the draft's modules_to_not_convert `keep`; experts (a mixture-of-experts MLP,
    which the check does not map) count as converted."""
    experts = sorted({n.split(".experts.")[0] + ".experts" for n in shapes if ".experts." in n})
    return experts + [
        module
        for module in linear_modules(shapes)
        if any(not any(entry in path for entry in keep) for path in nxdi_module_paths(module))
    ]


def refuse_quantized_draft(settings: NeuronSettings) -> None:
    """Refuse a fused draft model with quantized weights unless
    draft_model_modules_to_not_convert keeps all of it in float (module docstring)."""
    if settings.quantization is None or not settings.is_fused_speculation:
        return
    keep = settings.passthrough.get("draft_model_modules_to_not_convert") or []
    draft = str(settings.draft_model)
    converted = converted_draft_modules(safetensors_shapes(draft), keep)
    if not converted:
        return
    shown = ", ".join(converted[:4]) + (f" and {len(converted) - 4} more" if converted[4:] else "")
    raise NeuronConfigError(
        f"--speculative-config model={draft} with override_neuron_config quantized: true "
        f"on the nxd backend: NxDI converts the fused draft's linear layers not in "
        f"draft_model_modules_to_not_convert ({list(keep)}) to quantized ones like the "
        f"model's (model_wrapper.py load_module) but loads the draft's weights from its "
        f"own float folder, which has no scales, so the draft would propose garbage (no "
        f"speed-up) or fail to load: {shown} would be converted (NxDI matches the entries "
        f"in its own module paths, e.g. layers.0.self_attn.qkv_proj.q_proj). Keep the "
        f'whole draft in float with "draft_model_modules_to_not_convert": ["layers", '
        f'"lm_head"], serve the model unquantized, or use {{"method": "ngram", ...}} '
        f"speculation."
    )


def fused_qkv_entries(keep: Sequence[str], layers: int, setting: str) -> list[str]:
    """The exact `layers.{l}.self_attn` entries NxDI's fused-QKV conversion needs in
    modules_to_not_convert `keep` (module docstring): one per layer whose fused Wqkv the
    list keeps float and that lacks it. NeuronConfigError naming `setting` (where the
    list comes from) for a layer whose Wqkv is kept but whose o_proj is converted."""
    missing = []
    for layer in range(layers):
        attention = f"layers.{layer}.self_attn"
        if attention in keep or not _kept(f"{attention}.qkv_proj.Wqkv", keep):
            continue
        if not _kept(f"{attention}.o_proj.o_proj", keep):
            raise NeuronConfigError(
                f"override_neuron_config.{setting}={list(keep)} keeps {attention}'s q/k/v "
                f"projections "
                f"in float but quantizes its o_proj: with fused_qkv NxDI keeps a layer's "
                f"q/k/v scales out of Wqkv only for the exact entry {attention!r}, which "
                f"would keep o_proj in float as well; add {attention!r} (or "
                f"'self_attn.o_proj') to the list, or set fused_qkv false."
            )
        missing.append(attention)
    return missing


def _kept(path: str, keep: Sequence[str]) -> bool:
    return any(entry in path for entry in keep)


def complete_for_fused_qkv(neuron_config: Any, layers: int, setting: str) -> None:
    """Before NxDI reads a state dict with `neuron_config` (the model's or a fused
    draft's, of `layers` decoder layers; `setting`: the override key its
    modules_to_not_convert comes from): the entries fused_qkv_entries names added to
    it, where NxDI would concatenate scales."""
    scaled = getattr(neuron_config, "quantized", False) or getattr(
        neuron_config, "quantized_mlp_kernel_enabled", False
    )
    if not getattr(neuron_config, "fused_qkv", False) or not scaled:
        return
    keep = list(getattr(neuron_config, "modules_to_not_convert", None) or [])
    missing = fused_qkv_entries(keep, layers, setting)
    if missing:
        neuron_config.modules_to_not_convert = keep + missing
