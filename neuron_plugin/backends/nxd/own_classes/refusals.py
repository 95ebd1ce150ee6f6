"""What the plugin's own NxDI classes (families/gemma4, families/qwen3_5) refuse alike:
their layers are plain torch over NxD's parallel layers, so NeuronConfig keys that put
NxDI's kernels, parallelism or cache layouts on the path, speculation, LoRA and
quantization are refused before anything compiles (`problems`) and again when the class
is built directly (`taken`). Imports no NxDI: compat reads it in vLLM's environment."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.core.settings import NeuronSettings

# NeuronConfig attributes that are set whenever a draft, LoRA or quantization is
_FEATURES = ("kv_cache_tiling", "enable_fused_speculation", "lora_config", "quantized")


def problems(
    name: str, settings: NeuronSettings, keys: Mapping[str, str], degrees: Mapping[str, str]
) -> list[str]:
    """`name`'s refusals (keys: override_neuron_config key -> why the class does not take
    it; degrees: parallelism degree key -> what the class does not implement)."""
    found = []
    passthrough = settings.passthrough
    for key, why in keys.items():
        if passthrough.get(key):
            found.append(
                f"{name}: override_neuron_config {key}={passthrough[key]!r}: {why}; remove "
                f"it from override_neuron_config."
            )
    for key, what in degrees.items():
        if int(passthrough.get(key) or 1) > 1:
            found.append(
                f"{name}: override_neuron_config {key}={passthrough[key]!r}: the class does "
                f"not implement {what}; remove it from override_neuron_config."
            )
    if settings.speculation_method or settings.draft_model:
        found.append(
            f"{name} with speculative decoding ({settings.speculation_method}): NxDI's "
            f"fused speculation builds its drafts and verifies them with its own attention "
            f"(model_base.py NeuronFusedSpecModel), which the class does not implement; "
            f"remove --speculative-config."
        )
    if settings.max_loras:
        found.append(
            f"{name} with LoRA (--max-loras {settings.max_loras}): the class's projections "
            f"are not NxDI's LoRA modules (modules/lora_serving); remove --enable-lora."
        )
    if settings.quantization is not None:
        found.append(
            f"{name} with a quantized checkpoint: the class's layers are NxD's float "
            f"parallel linears, which NxDI's quantization does not convert; serve the "
            f"float checkpoint."
        )
    return found


def taken(neuron_config: Any, keys: Mapping[str, str], degrees: Mapping[str, str]) -> list[str]:
    """The NeuronConfig attributes among `keys`, `degrees` (above 1), speculation, LoRA
    and quantization that `neuron_config` sets."""
    found = [name for name in (*keys, *_FEATURES) if getattr(neuron_config, name, None)]
    found += [name for name in degrees if int(getattr(neuron_config, name, 0) or 0) > 1]
    if int(getattr(neuron_config, "speculation_length", 0) or 0) > 0:
        found.append("speculation_length")
    return found
