"""Mistral on NxDI: Llama's window rule (`llama`), one window over every layer."""

from __future__ import annotations

from neuron_plugin.backends.nxd.families import NxDFamily
from neuron_plugin.backends.nxd.families.llama import (
    drop_window,
    windowed_problems,
    windows_from_config,
)
from neuron_plugin.backends.nxd.support import (
    COMMON,
    EQUAL,
    WINDOWED_SPECULATION,
    Support,
    not_listed_0_8,
)

# NxDI's windowed attention in the block layout (llama.windowed_block_problems)
WINDOW_BLOCK = Support(
    EQUAL,
    "with max_model_len <= sliding_window (served as full attention); refused below it: "
    "NxDI's windowed attention keeps window - 1 keys that its block KV cache cannot write",
)

FAMILY = NxDFamily(
    support=not_listed_0_8(
        {
            **COMMON,
            "block": WINDOW_BLOCK,
            "prefix_hit": WINDOW_BLOCK,
            "speculation": WINDOWED_SPECULATION,
        }
    ),
    windows=windows_from_config,
    problems=windowed_problems,
    adjustments=drop_window,
)
