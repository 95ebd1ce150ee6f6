"""Llama on NxDI: its model and attention read config.sliding_window for every layer
(modeling_llama.py NeuronLlamaAttention, NeuronLlamaModel.setup_attr_for_model), which
transformers' Llama ignores; Mistral shares the rule (`mistral`)."""

from __future__ import annotations

from typing import Any

from neuron_plugin.backends.nxd.families import NxDFamily, Text, layers
from neuron_plugin.backends.nxd.support import COMMON, by_release
from neuron_plugin.core.settings import NeuronSettings


def window_dropped(text: Text, max_model_len: int) -> bool:
    """Whether the backend gives NxDI the config without its sliding window: NxDI reads
    one window for every layer and no sequence can be longer than it, so full attention
    is what transformers computes."""
    window = text.get("sliding_window")
    return window is not None and max_model_len <= window


def windows_from_config(text: Text, max_model_len: int) -> tuple[int | None, ...]:
    window = None if window_dropped(text, max_model_len) else text.get("sliding_window")
    return (window,) * layers(text)


def drop_window(settings: NeuronSettings, text: Text) -> dict[str, Any]:
    return {"sliding_window": None} if window_dropped(text, settings.max_model_len) else {}


def windowed_block_problems(
    settings: NeuronSettings,
    hf_config: Any,
    text: Text,
    release: str,
    patch_status: Any,
) -> list[str]:
    """NxDI's windowed attention in the block layout: `windowed_attention_forward` keeps
    the last window - 1 keys of a prefill (attention_base.py get_last_kv_window), which
    `BlockKVCacheManager.update_cache` cannot write."""
    window = windows_from_config(text, settings.max_model_len)[0]
    if not settings.is_block_layout or window is None:
        return []
    return [
        f"{settings.architecture} with sliding_window={window} below max_model_len="
        f"{settings.max_model_len} in the block KV layout ({settings.kv_layout_reason}) on "
        f"{release}: its windowed attention keeps the last {window - 1} keys of a prefill "
        f"(attention_base.py windowed_attention_forward, get_last_kv_window), which "
        f"BlockKVCacheManager.update_cache cannot write (it fails for every prompt); serve "
        f"without --enable-prefix-caching and chunked prefill (contiguous layout), or with "
        f"--max-model-len {window} or less (then no key leaves the window and NxDI gets the "
        f"config without it)."
    ]


FAMILY = NxDFamily(
    support=by_release(COMMON),
    windows=windows_from_config,
    problems=windowed_block_problems,
    adjustments=drop_window,
)
