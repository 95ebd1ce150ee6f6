"""modules/attention/attention_base.py: NeuronAttentionBase.perform_prefix_prefill, the
attention of a context encoding over a cached prefix (prefix caching, block layout).

As in NxDI 0.6-0.9 (ef2731e lines 772-906): with no flash-attention kernel chosen
(`get_flash_attention_strategy` -> NONE: on LNC 1 a prefill bucket below 4096, the CPU
always) the prior scores Q.K_prior are *not* masked with `attention_mask`, the
[batch, prefix bucket] mask of the cached prefix NxDI's wrapper built; only the active
scores are (causal `active_mask`). So every position of the prefix bucket read through
the block table is attended: the prefix tail that `_pad_prefix_caching_inputs` moved into
the active part (twice), positions past the cached prefix, and never-written slots. The
kernel strategies pass the mask's row sums as `prior_used_len` and are not reproduced.

The scores are divided by the attention's `softmax_scale` from 0.9 (set in __init__:
sqrt(head_dim) unless a model passes its own, ef2731e line 253); 0.7 and 0.8 have no such
attribute and divide by `math.sqrt(self.head_dim)` (0.8 cd3abf3 lines 1062, 1066).
"""

import math
from enum import Enum

import torch

from neuronx_distributed_inference._release import RELEASE
from neuronx_distributed_inference.modules.attention.utils import manual_softmax, repeat_kv

HAS_SOFTMAX_SCALE = RELEASE.startswith("0.9")


class FlashAttentionStrategy(Enum):
    NONE = 0
    UNSHARDED_KERNEL = 1
    SHARDED_KERNEL = 2


class NeuronAttentionBase(torch.nn.Module):
    """The attributes perform_prefix_prefill reads: head grouping, head size, the softmax
    scale (0.9), whether the K cache is stored transposed, and the kernel choice."""

    if HAS_SOFTMAX_SCALE:
        def __init__(self, num_key_value_groups=1, head_dim=2, softmax_scale=None,
                     k_cache_transposed=False):
            super().__init__()
            self.num_key_value_groups = num_key_value_groups
            self.head_dim = head_dim
            self.softmax_scale = math.sqrt(head_dim) if softmax_scale is None else softmax_scale
            self.k_cache_transposed = k_cache_transposed
    else:
        def __init__(self, num_key_value_groups=1, head_dim=2, k_cache_transposed=False):
            super().__init__()
            self.num_key_value_groups = num_key_value_groups
            self.head_dim = head_dim
            self.k_cache_transposed = k_cache_transposed

    def get_flash_attention_strategy(self, q_len, has_attention_mask=True):
        return FlashAttentionStrategy.NONE

    def perform_prefix_prefill(self, Q, K, V, q_len, bsz, attention_mask, past_key_value,
                               active_mask):
        K_prior, V_prior = past_key_value[0], past_key_value[1]
        strategy = self.get_flash_attention_strategy(q_len, has_attention_mask=False)
        if strategy != FlashAttentionStrategy.NONE:
            raise NotImplementedError("the NxDI double reproduces the non-kernel branch only")
        K_active = repeat_kv(K, self.num_key_value_groups)
        V_active = repeat_kv(V, self.num_key_value_groups)
        K_prior = repeat_kv(K_prior, self.num_key_value_groups)
        V_prior = repeat_kv(V_prior, self.num_key_value_groups)
        if not self.k_cache_transposed:
            K_prior = K_prior.transpose(2, 3)
        scale = self.softmax_scale if HAS_SOFTMAX_SCALE else math.sqrt(self.head_dim)
        prior_scores = (torch.matmul(Q, K_prior) / scale).to(torch.float32)
        active_scores = torch.matmul(Q, K_active.transpose(2, 3)) / scale
        active_scores = torch.where(active_mask, active_scores,
                                    torch.finfo(active_scores.dtype).min).to(torch.float32)
        softmax_prior, softmax_active = manual_softmax(prior_scores, active_scores, True)
        attn_output = (torch.matmul(softmax_prior.to(Q.dtype), V_prior)
                       + torch.matmul(softmax_active.to(Q.dtype), V_active))
        return attn_output, strategy
