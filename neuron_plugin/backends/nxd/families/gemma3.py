"""Gemma 3 (text) on NxDI: NxDI's class with the plugin's gemma3 patches
(`neuron_plugin.patches.gemma3`): without them its tokens are wrong; keys NxDI does not
implement (soft-capping, RoPE scaling other than linear) are refused. NxDI 0.9 lists the
class in MODEL_TYPES; 0.8 ships an earlier models/gemma3 without listing it, which the
architecture table names there (its defects differ: the patches probe each release)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd.families import NxDFamily, Text, transformers_windows
from neuron_plugin.backends.nxd.support import (
    COMMON,
    EQUAL,
    LORA_0_8,
    WINDOWED_SPECULATION,
    Support,
    by_release,
)
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.patches import gemma3

PATCHES = tuple(patch.name for patch in gemma3.PATCHES)
# What each release's module needs (tests/e2e/test_nxdi_patches.py finds exactly these);
# gemma3-cpu-norm on 0.8 only in NxDI's CPU mode, which no device runs.
PATCHES_0_9 = (gemma3.NAME_CONFIG, gemma3.NAME_ROPE, gemma3.NAME_WINDOW, gemma3.NAME_NORMS)
PATCHES_0_8 = (gemma3.NAME_CONFIG, gemma3.NAME_ROPE, gemma3.NAME_WINDOW, gemma3.NAME_SCALE)


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    name = f"Gemma3ForCausalLM on {release}"
    found = []
    disabled = [p for p in PATCHES if patch_status.get(p) == "disabled"]
    if disabled:
        found.append(
            f"{name} without the plugin's patches {', '.join(disabled)} "
            f"(VLLM_NEURON_DISABLE_PATCHES): NxDI's Gemma3 then hard-codes the vocabulary, "
            f"RoPE and layer pattern (modeling_gemma3.py Gemma3InferenceConfig), reuses the "
            f"local layers' RoPE in global layers, attends all positions in local layers, "
            f"rounds norm weights to bfloat16 (0.9) and scales scores by head_dim instead "
            f"of query_pre_attn_scalar (0.8), so its tokens are wrong; remove them from "
            f"VLLM_NEURON_DISABLE_PATCHES."
        )
    if settings.is_block_layout and patch_status.get("prefix-prefill-mask") == "disabled":
        found.append(
            f"{name} in the block KV layout without the prefix-prefill-mask patch: a "
            f"prefix-cache hit's local layers see their window only through that patch's "
            f"masked prefill; remove it from VLLM_NEURON_DISABLE_PATCHES."
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            found.append(
                f"{name}: {key}={text[key]!r}, which NxDI's Gemma3 does not apply "
                f"(modeling_gemma3.py); serve it on the reference backend."
            )
    rope = text.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type")) != "linear":
        found.append(
            f"{name}: rope_scaling {dict(rope)}; NxDI's Gemma3 scales RoPE linearly only "
            f"(RotaryEmbedding factor); serve it on the reference backend."
        )
    return found


def windows(text: Text, max_model_len: int) -> tuple[int | None, ...]:
    """The checkpoint's layer types (patch gemma3-config), as transformers reads them."""
    return transformers_windows("Gemma3ForCausalLM", text)


def _table(patches: tuple[str, ...]) -> dict[str, Support]:
    return {
        **COMMON,
        "contiguous": Support(EQUAL, "with the plugin's patches " + ", ".join(patches)),
        "speculation": WINDOWED_SPECULATION,
    }


FAMILY = NxDFamily(
    support=by_release(
        _table(PATCHES_0_9),
        {
            **_table(PATCHES_0_8),
            "contiguous": Support(
                EQUAL,
                "NxDI 0.8's unlisted models/gemma3 with the plugin's patches "
                + ", ".join(PATCHES_0_8),
            ),
            "lora": LORA_0_8,
        },
    ),
    windows=windows,
    problems=problems,
)
