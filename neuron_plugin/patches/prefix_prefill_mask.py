"""Patch `prefix-prefill-mask`: a prefix-cache hit attends its cached prefix only once.

With prefix caching NxDI encodes a prompt whose first blocks are cached by reading the
prefix bucket's blocks (the "prior" keys) and encoding the rest, plus the tail of the
prefix that fits into the prefill bucket's spare slots, as active keys
(model_wrapper._pad_prefix_caching_inputs; its attention mask covers the cached part
that was *not* moved). For a prefill bucket of 128 tokens or more the attention is
`NeuronAttentionBase.perform_prefix_prefill`, whose branch without a flash-attention
kernel never applies that mask to the prior scores (NxDI 0.6 to 0.9, e.g. 0.9 ef2731e
attention_base.py lines 882-906): the moved tail is attended twice and positions past
the prefix (other requests' or never-written slots of the last block) once. On inf2 and
trn1 (LNC 1) that branch is traced for every prefill bucket below 4096 (below 512 with
`attn_kernel_enabled`). Measured with NxDI 0.9's CPU mode on a tiny Llama: logits off by
8.8 at a 128-token bucket; masked, within 1e-5 of transformers. The fix runs that branch
with the prior scores masked by the attention mask, and leaves the kernel branches
(which pass the mask's row sums as `prior_used_len`) to NxDI. It scales the scores as
the installed release does (`softmax_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

from neuron_plugin.patches.base import NxDIModules, Patch, replace_method, unpatched

NAME = "prefix-prefill-mask"


def softmax_scale(attention: Any) -> float:
    """What the release divides attention scores by: the attention's `softmax_scale`
    from NxDI 0.9 (attention_base.py NeuronAttentionBase.__init__, ef2731e line 253,
    sqrt(head_dim) unless the model passes its own, as Gemma3 does); NxDI 0.6-0.8 have no
    such attribute and divide by `math.sqrt(self.head_dim)` (0.8 cd3abf3
    perform_prefix_prefill, lines 1062 and 1066)."""
    scale = getattr(attention, "softmax_scale", None)
    return math.sqrt(attention.head_dim) if scale is None else float(scale)


def masked_prefix_prefill(
    attention: Any,
    module: ModuleType,
    Q: Any,
    K: Any,
    V: Any,
    attention_mask: Any,
    past_key_value: Any,
    active_mask: Any,
) -> Any:
    """softmax over [prior scores where the prefix mask is 1; causal active scores],
    then the weighted values: NxDI's non-kernel prefix prefill with the missing mask.
    The mask is NxDI's [batch, prefix], or one per query [batch, 1, q, prefix] (a Gemma3
    local layer's window, patch gemma3-window)."""
    import torch

    groups = attention.num_key_value_groups
    scale = softmax_scale(attention)
    k_prior = module.repeat_kv(past_key_value[0], groups)
    v_prior = module.repeat_kv(past_key_value[1], groups)
    if not attention.k_cache_transposed:
        k_prior = k_prior.transpose(2, 3)
    prior = (torch.matmul(Q, k_prior) / scale).to(torch.float32)
    visible = attention_mask.to(torch.bool)
    if visible.dim() == 2:  # [batch, prefix]; a query-wise [batch, 1, q, prefix] as given
        visible = visible[:, None, None, :]
    prior = torch.where(visible, prior, torch.finfo(prior.dtype).min)
    active = torch.matmul(Q, module.repeat_kv(K, groups).transpose(2, 3))
    active = (active / scale).to(torch.float32)
    active = torch.where(active_mask, active, torch.finfo(active.dtype).min)
    weights_prior, weights_active = module.manual_softmax(prior, active, True)
    return torch.matmul(weights_prior.to(Q.dtype), v_prior) + torch.matmul(
        weights_active.to(Q.dtype), module.repeat_kv(V, groups)
    )


def _stand_in(module: ModuleType) -> SimpleNamespace:
    """The attributes perform_prefix_prefill reads, with no kernel chosen."""
    return SimpleNamespace(
        get_flash_attention_strategy=lambda *a, **k: module.FlashAttentionStrategy.NONE,
        num_key_value_groups=1,
        softmax_scale=1.0,
        k_cache_transposed=False,
        padding_side="right",
        logical_nc_config=1,
        num_heads=1,
        num_key_value_heads=1,
        head_dim=2,
    )


def probe(modules: NxDIModules) -> str | None:
    """Run NxDI's prefix prefill twice on one query over two cached keys, the second
    masked out, with different values behind the masked key: the output must not move."""
    import torch

    module = modules.attention_base
    cls = getattr(module, "NeuronAttentionBase", None)
    if cls is None or not hasattr(cls, "perform_prefix_prefill"):
        return None
    run = unpatched(cls.perform_prefix_prefill)
    zeros = torch.zeros(1, 1, 1, 2)
    mask = torch.tensor([[1, 0]])
    outputs = []
    for hidden in (0.0, 100.0):
        v_prior = torch.tensor([[[[1.0, 0.0], [hidden, hidden]]]])
        out, _ = run(
            _stand_in(module),
            zeros,
            zeros,
            torch.ones(1, 1, 1, 2),
            1,
            1,
            mask,
            (torch.zeros(1, 1, 2, 2), v_prior),
            torch.ones(1, 1, 1, 1, dtype=torch.bool),
        )
        outputs.append(out)
    if torch.allclose(outputs[0], outputs[1]):
        return None
    return (
        "perform_prefix_prefill attends cached positions its attention mask excludes "
        "(prefix-cache hits with a prefill bucket >= 128 compute wrong logits)"
    )


def apply(modules: NxDIModules) -> bool:
    module = modules.attention_base

    def make(original: Callable) -> Callable:
        def perform_prefix_prefill(
            self, Q, K, V, q_len, bsz, attention_mask, past_key_value, active_mask
        ):
            strategy = self.get_flash_attention_strategy(q_len, has_attention_mask=False)
            if strategy != module.FlashAttentionStrategy.NONE:
                return original(
                    self, Q, K, V, q_len, bsz, attention_mask, past_key_value, active_mask
                )
            return masked_prefix_prefill(
                self, module, Q, K, V, attention_mask, past_key_value, active_mask
            ), strategy

        return perform_prefix_prefill

    return replace_method(module.NeuronAttentionBase, "perform_prefix_prefill", NAME, make)


PATCH = Patch(
    name=NAME,
    defect="prefix prefill attends cached positions its mask excludes (no kernel)",
    probe=probe,
    apply=apply,
)
