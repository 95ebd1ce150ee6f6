"""Mistral on NxDI: Llama's window rule (`llama`), one window over every layer. NxDI 0.9
(ef2731e) lists its own NeuronMistralForCausalLM; 0.8 (cd3abf3) lists none, and the
architecture table serves Mistral there with 0.8's NeuronLlamaForCausalLM, which reads
the same config.sliding_window for its attention and its masks (modeling_llama.py lines
1010, 1350; model_base.py lines 377-385, 834-840) and Mistral's own head_dim (line 1003):
measured equal to transformers' MistralForCausalLM in every case 0.9's class is."""

from __future__ import annotations

from neuron_plugin.backends.nxd.families import NxDFamily
from neuron_plugin.backends.nxd.families.llama import (
    drop_window,
    windowed_block_problems,
    windows_from_config,
)
from neuron_plugin.backends.nxd.support import (
    COMMON,
    EQUAL,
    LORA_0_8,
    WINDOWED_SPECULATION,
    Support,
    by_release,
)

# NxDI's windowed attention in the block layout (llama.windowed_block_problems)
WINDOW_BLOCK = Support(
    EQUAL,
    "with max_model_len <= sliding_window (served as full attention); refused below it: "
    "NxDI's windowed attention keeps window - 1 keys that its block KV cache cannot write",
)
TABLE_0_9 = {
    **COMMON,
    "block": WINDOW_BLOCK,
    "prefix_hit": WINDOW_BLOCK,
    "speculation": WINDOWED_SPECULATION,
}
TABLE_0_8 = {
    **TABLE_0_9,
    "contiguous": Support(
        EQUAL, "NxDI 0.8's Llama class (0.8 lists no Mistral), which applies sliding_window"
    ),
    "lora": LORA_0_8,
}

FAMILY = NxDFamily(
    support=by_release(TABLE_0_9, TABLE_0_8),
    windows=windows_from_config,
    problems=windowed_block_problems,
    adjustments=drop_window,
)
