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
  (load_module converts `draft_model` and `target_model`, the draft's config being a
  copy of the target's) but loads the draft from its own float folder, which has no
  scales (checkpoint_loader_fn): a load failure or a garbage draft that never proposes
  an accepted token. Refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import safetensors_header
from neuron_plugin.core.quantization import Quantization
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


def refuse_quantized_draft(settings: NeuronSettings) -> None:
    """Refuse a fused draft model with quantized weights (module docstring)."""
    if settings.quantization is None or not settings.is_fused_speculation:
        return
    raise NeuronConfigError(
        f"--speculative-config model={settings.draft_model} with override_neuron_config "
        f"quantized: true on the nxd backend: NxDI converts the fused draft's layers to "
        f"quantized ones like the model's (model_wrapper.py load_module) but loads the "
        f"draft's weights from its own float folder, which has no scales, so the draft "
        f"would propose garbage (no speed-up) or fail to load. Serve the draft with an "
        f'unquantized model (remove quantized), or use {{"method": "ngram", ...}} '
        f"speculation with the quantized model."
    )
