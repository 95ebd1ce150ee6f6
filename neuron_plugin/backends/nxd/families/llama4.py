"""Llama 4 on NxDI: NxDI's image-to-text application (`backends/nxd/image_to_text.py`,
its vision tower run by `backends/nxd/llama4_vision.py`), equal to transformers with
images once patch `llama4-rope-temperature` gives its text model the checkpoint's RoPE
scaling and attention temperature tuning; measured through the plugin's backend on NxDI
0.8 and 0.9 (tests/e2e/test_nxdi_llama4.py), in the contiguous layout only: NxDI's
Llama4InferenceConfig raises for the block layout and prefix caching."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd import image_to_text
from neuron_plugin.backends.nxd.families import Text, one_decode_length
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.patches import llama4_rope

# measured in the XLA replay on 0.8 and 0.9, the eager forward too: with chunked
# attention (model_base.py get_model_output: KVCacheManager.get_cache with the chunk size
# and the per-layer sizes of get_layer_to_kv_cache_size_mapping_for_mixed_attn)
_WHOLE_CACHE = (
    "NxDI's Llama 4 hands its global (NoPE) layers their whole KV cache whatever the bucket"
)


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    """The RoPE the patch computes is llama3 scaling, so a checkpoint scaling another
    way is refused; so are decode buckets shorter than the longest (`_WHOLE_CACHE`)."""
    found = []
    rope = text.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if rope and kind != "llama3":
        found.append(
            f"{settings.architecture}: rope_scaling {dict(rope)}; the plugin computes Llama "
            f"4's scaled RoPE the llama3 way only (patch llama4-rope-temperature); serve it "
            f"with VLLM_NEURON_BACKEND=reference."
        )
    return found + one_decode_length(settings, settings.architecture, _WHOLE_CACHE)


FAMILY = image_to_text.family(
    "Llama 4",
    "Llama4InferenceConfig raises",
    "one or more per prompt, in tiles",
    patches=(llama4_rope.NAME,),
    without="NxDI's Llama 4 would ignore the checkpoint's RoPE scaling and temperature tuning",
    more_problems=problems,
)
