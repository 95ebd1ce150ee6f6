"""How NxDI spreads a model's attention heads over the tensor-parallel ranks: how many KV
heads each NeuronCore holds (the memory plan) and which of the model's KV heads each of
them is (the KV transfer moves each distinct head once).

NxDI's rule (modules/attention/gqa.py, the same in NxDI 0.7-0.9; lines of ef2731e, 0.9,
and cd3abf3, 0.8):
- `determine_sharding_strategy` (62-75 / 89-102): REPLICATE_TO_TP_DEGREE, or
  CONVERT_TO_MHA where the TP degree is not a multiple of the KV heads, for grouped-query
  and multi-head models alike;
- `get_shardable_head_counts` (78-100 / 105-127): the attention heads padded to a
  multiple of the TP degree (neuronx-distributed parallel_layers/pad.py
  `get_number_of_extra_heads`); multi-head attention keeps one KV head per (padded)
  attention head; a GQA/MQA model whose KV heads are fewer than the TP degree or not a
  multiple of it gets TP KV heads (REPLICATE_TO_TP_DEGREE) or as many as the padded
  attention heads (CONVERT_TO_MHA); otherwise its KV heads split evenly;
- `GroupQueryAttention_QKV.preshard_hook` (783-864 / 998-1079): wherever that count
  differs from the model's, `replicate_kv` repeats each KV head in place
  (repeat_interleave: head h fills the next `repeats` slots), repeats = TP / KV heads
  under REPLICATE_TO_TP_DEGREE, attention heads / KV heads under CONVERT_TO_MHA (1 for
  multi-head attention); only CONVERT_TO_MHA then appends padding heads with zero
  weights (`maybe_pad_tail`), so their K and V are zero; REPLICATE_TO_TP_DEGREE pads
  the queries instead, a zero head after each KV head's group (`maybe_pad_interleaved`);
- the KV cache holds the padded count / TP heads per rank, rank r the slots
  [r x per_rank, (r + 1) x per_rank) (modules/kvcache/kv_cache_manager.py
  `_get_num_kv_heads_per_rank`, 166-186).
So Llama-3-8B (32 attention heads, 8 KV heads) holds 1 KV head per core at TP 8, 16 or
32 (each head on 1, 2 or 4 cores) and 3 at TP 12 (MHA, 36 heads: each KV head 4 times,
4 padding heads); a multi-head model of 8 heads at TP 16 holds head r // 2 on rank r.

Pure: no vLLM, torch or NxDI import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REPLICATE = "replicate-to-tp-degree"  # gqa.GQA.REPLICATE_TO_TP_DEGREE
CONVERT_TO_MHA = "convert-to-mha"  # gqa.GQA.CONVERT_TO_MHA


@dataclass(frozen=True)
class HeadSharding:
    """The model's heads as NxDI shards them over `tp_degree` ranks (module docstring)."""

    tp_degree: int
    attention_heads: int
    kv_heads: int
    strategy: str
    padded_attention_heads: int
    padded_kv_heads: int  # KV heads over all ranks: replicas and padding included

    @property
    def kv_heads_per_core(self) -> int:
        return self.padded_kv_heads // self.tp_degree

    @property
    def slot_heads(self) -> tuple[int | None, ...]:
        """For each of the padded_kv_heads slots, in rank order, the model's KV head it
        holds a copy of (None: a padding head, zero)."""
        if self.padded_kv_heads == self.kv_heads:
            return tuple(range(self.kv_heads))
        if self.strategy == REPLICATE:
            repeats = self.tp_degree // self.kv_heads
        else:
            repeats = self.attention_heads // self.kv_heads
        real = self.kv_heads * repeats
        return tuple(j // repeats if j < real else None for j in range(self.padded_kv_heads))

    def describe(self) -> str:
        """One line for explain-config."""
        per_core = f"{self.kv_heads_per_core} per NeuronCore"
        if self.padded_kv_heads == self.kv_heads:
            return f"{self.kv_heads} KV heads split over TP {self.tp_degree}: {per_core}"
        if self.strategy == REPLICATE:
            return (
                f"{self.kv_heads} KV heads replicated to TP {self.tp_degree} "
                f"({self.tp_degree // self.kv_heads} copies each): {per_core}"
            )
        padding = self.padded_kv_heads - len([h for h in self.slot_heads if h is not None])
        return (
            f"{self.kv_heads} KV heads at TP {self.tp_degree}: NxDI converts to multi-head "
            f"attention, {self.attention_heads} attention heads padded to "
            f"{self.padded_attention_heads}, {self.padded_kv_heads} KV heads ({padding} of "
            f"them padding): {per_core}"
        )


def head_sharding(tp_degree: int, attention_heads: int, kv_heads: int) -> HeadSharding:
    """NxDI's determine_sharding_strategy and get_shardable_head_counts (module docstring)."""
    strategy = REPLICATE if tp_degree % kv_heads == 0 else CONVERT_TO_MHA
    padded_attention = attention_heads + (-attention_heads % tp_degree)
    padded_kv = kv_heads
    if attention_heads == kv_heads:
        padded_kv = padded_attention
    elif kv_heads < tp_degree or kv_heads % tp_degree:
        padded_kv = tp_degree if strategy == REPLICATE else padded_attention
    return HeadSharding(tp_degree, attention_heads, kv_heads, strategy, padded_attention, padded_kv)


def model_head_sharding(hf_config: Mapping[str, Any], tp_degree: int) -> HeadSharding:
    """The sharding of a Hugging Face config's text model (its `text_config` if nested)."""
    text = hf_config.get("text_config") or hf_config
    heads = int(text["num_attention_heads"])
    return head_sharding(tp_degree, heads, int(text.get("num_key_value_heads") or heads))


def head_dim(hf_config: Mapping[str, Any]) -> int:
    text = hf_config.get("text_config") or hf_config
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
