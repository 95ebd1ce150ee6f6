"""Prompt logprobs inside a graph: [positions, vocab] logits in, O(k) per position out.

What vLLM's GPU runner computes for a prompt (`Sampler.compute_logprobs`, float32
log-softmax, then `Sampler.gather_logprobs`: the target token's logprob, the top k, and
the target's rank, the count of tokens at least as likely), written once for every
backend's graph so that only [positions, k + 1] ids and values leave the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neuron_plugin.core.prompt_logprobs import NO_TARGET


def top_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [..., k + 1] int32, logprobs [..., k + 1] float32, ranks [...] int64) of
    `logits` [..., vocab] for `targets` [...] (NO_TARGET positions score token 0, for
    the host to drop): column 0 the target, then the k most likely tokens."""
    return sharded_top_logprobs(logits, targets, k, 0, _whole)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The gather of a vocabulary held by one rank."""
    return tensor


def sharded_top_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    rank: torch.Tensor | int,
    gather: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_logprobs` where the vocabulary is split across tensor-parallel ranks, as a
    column-parallel lm_head leaves it: `logits` [..., shard] is rank `rank`'s slice
    (token ids rank * shard ...), `gather` concatenates a tensor's last dimension over
    the ranks in rank order (an all-gather; the identity with one rank). Only
    [..., ranks] statistics and [..., ranks * k] candidates cross ranks, never the
    vocabulary: the log-sum-exp from each shard's max and sum, the target's logprob
    from the shard that holds it, its rank as a sum of counts, and the top k of the
    shards' top k (NxDI's own sampler takes a sharded top-k the same way,
    modules/generation/sampling.py `_batch_sharded_topk`)."""
    local = logits.float()
    shard = local.shape[-1]
    offset = rank * shard
    local_max = local.max(dim=-1, keepdim=True).values
    local_sum = (local - local_max).exp().sum(dim=-1, keepdim=True)
    maxes = gather(local_max)
    top = maxes.max(dim=-1, keepdim=True).values
    lse = top + (gather(local_sum) * (maxes - top).exp()).sum(dim=-1, keepdim=True).log()
    logprobs = local - lse
    target = torch.where(targets == NO_TARGET, torch.zeros_like(targets), targets).unsqueeze(-1)
    index = target - offset
    held = (index >= 0) & (index < shard)
    picked = logprobs.gather(-1, index.clamp(0, shard - 1))
    lowest = torch.full_like(picked, torch.finfo(torch.float32).min)
    target_logprob = gather(torch.where(held, picked, lowest)).max(dim=-1, keepdim=True).values
    ranks = gather((logprobs >= target_logprob).sum(dim=-1, keepdim=True)).sum(dim=-1)
    values, ids = torch.topk(logprobs, min(k, shard), dim=-1)
    candidates, candidate_ids = gather(values), gather(ids + offset)
    top_values, chosen = torch.topk(candidates, k, dim=-1)
    top_ids = candidate_ids.gather(-1, chosen)
    ids_out = torch.cat((target, top_ids), dim=-1).to(torch.int32)
    return ids_out, torch.cat((target_logprob, top_values), dim=-1), ranks
