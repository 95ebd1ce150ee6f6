"""Run under an interpreter with NxD Inference: how that real release shards attention
heads over TP ranks, for each (attention heads, KV heads, TP degree) given. Prints one
JSON list, per combination NxDI's own strategy and padded head counts
(modules/attention/gqa.py BaseGroupQueryAttention.__init__: determine_sharding_strategy,
get_shardable_head_counts) and, from GroupQueryAttention_QKV.preshard_hook run on a state
dict whose rows name their head, the model head each padded query and KV slot holds
(null: a zero padding head).

    python nxdi_head_sharding_probe.py '[[heads, kv_heads, tp], ...]'
"""

from __future__ import annotations

import json
import sys

import torch

from neuron_plugin.backends.nxd.nxdi import import_nxdi

PREFIX = "layers.0.self_attn"


def _hook_class():
    """BaseGroupQueryAttention with GroupQueryAttention_QKV's hook and weight accessors:
    NxDI's own code, without the parallel linear layers its __init__ would build."""
    from neuronx_distributed_inference.modules.attention import gqa

    qkv = gqa.GroupQueryAttention_QKV
    return type("HookOnly", (gqa.BaseGroupQueryAttention,), {
        "preshard_hook": qkv.preshard_hook,
        "get_weight": qkv.get_weight,
        "set_weight": qkv.set_weight,
    })


def _rows(count: int) -> torch.Tensor:
    """One row per head (head_dim 1, hidden 1) holding the head's number + 1."""
    return torch.arange(1, count + 1, dtype=torch.float32).reshape(count, 1)


def _slots(tensor: torch.Tensor) -> list[int | None]:
    return [int(v) - 1 if v else None for v in tensor.flatten().tolist()]


def shard(hook_class, heads: int, kv_heads: int, tp: int) -> dict:
    module = hook_class(hidden_size=1, head_dim=1, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, tp_degree=tp)
    module.fused_qkv = False
    module.q_proj = module.k_proj = module.v_proj = torch.nn.Identity()
    state = {f"{PREFIX}.q_proj.weight": _rows(heads),
             f"{PREFIX}.k_proj.weight": _rows(kv_heads),
             f"{PREFIX}.v_proj.weight": _rows(kv_heads)}
    module.preshard_hook(state, f"{PREFIX}.qkv_proj.")
    return {
        "heads": heads, "kv_heads": kv_heads, "tp": tp,
        "strategy": module.sharding_strategy.value,
        "padded_heads": module.num_attention_heads,
        "padded_kv_heads": module.num_key_value_heads,
        "q_slots": _slots(state[f"{PREFIX}.qkv_proj.q_proj.weight"]),
        "kv_slots": _slots(state[f"{PREFIX}.qkv_proj.k_proj.weight"]),
        "v_slots": _slots(state[f"{PREFIX}.qkv_proj.v_proj.weight"]),
    }


if __name__ == "__main__":
    import_nxdi()  # the plugin's way in: stubs checked, patches applied
    hook = _hook_class()
    print(json.dumps([shard(hook, *case) for case in json.loads(sys.argv[1])]))
