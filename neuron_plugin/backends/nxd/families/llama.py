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


def short_bucket_problems(settings: NeuronSettings, window: int | None, name: str) -> list[str]:
    """NxDI's CPU mode and a context-encoding bucket shorter than a window: its windowed
    attention keeps the last window - 1 keys of a prefill by gathering them from the
    bucket's own keys at indices up to window - 2 whatever the bucket's length
    (attention_base.py windowed_attention_forward -> modules/attention/utils.py
    get_last_kv_window: 0.9 ef2731e lines 2455 and 651-676, 0.8 cd3abf3 lines 3177 and
    676-701). Eager torch refuses an index past a shorter bucket's end (IndexError at the
    first prompt in it, measured on 0.8 and 0.9 by tests/e2e/test_nxdi_xla.py); a traced
    graph takes the indices as XLA clamps them (the bucket's last key repeated into slots
    the decode masks until it writes them), so a device is left alone."""
    if window is None or not settings.passthrough.get("on_cpu"):
        return []
    keep = window - 1
    short = [b for b in settings.context_encoding_buckets if b < keep]
    if not short:
        return []
    return [
        f"{name}: context_encoding_buckets {short} are shorter than sliding_window - 1 = "
        f"{keep}, the keys NxDI's windowed attention keeps of a prefill; it gathers them "
        f"from the bucket's own keys (attention_base.py windowed_attention_forward, "
        f"get_last_kv_window), which eager torch refuses past a shorter bucket's end "
        f"(IndexError in NxDI's CPU mode at the first prompt in it; a device's XLA clamps "
        f"the indices): use context-encoding buckets of at least {keep} tokens "
        f"(--max-model-len {keep} or more), or check this model on the reference backend."
    ]


def windowed_problems(
    settings: NeuronSettings,
    hf_config: Any,
    text: Text,
    release: str,
    patch_status: Any,
) -> list[str]:
    """`windowed_block_problems` and, in the CPU mode, `short_bucket_problems`."""
    window = windows_from_config(text, settings.max_model_len)[0]
    name = f"{settings.architecture} on {release}"
    return windowed_block_problems(
        settings, hf_config, text, release, patch_status
    ) + short_bucket_problems(settings, window, name)


FAMILY = NxDFamily(
    support=by_release(COMMON),
    windows=windows_from_config,
    problems=windowed_problems,
    adjustments=drop_window,
)
