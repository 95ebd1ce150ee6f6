"""Prompt logprobs inside a graph: [positions, vocab] logits in, O(k) per position out.

What vLLM's GPU runner computes for a prompt (`Sampler.compute_logprobs`, float32
log-softmax, then `Sampler.gather_logprobs`: the target token's logprob, the top k, and
the target's rank, the count of tokens at least as likely), written once for every
backend's graph so that only [positions, k + 1] ids and values leave the device.
"""

from __future__ import annotations

import torch

from neuron_plugin.core.prompt_logprobs import NO_TARGET


def top_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [..., k + 1] int32, logprobs [..., k + 1] float32, ranks [...] int64) of
    `logits` [..., vocab] for `targets` [...] (NO_TARGET positions score token 0, for
    the host to drop): column 0 the target, then the k most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    target = torch.where(targets == NO_TARGET, torch.zeros_like(targets), targets).unsqueeze(-1)
    target_logprob = logprobs.gather(-1, target)
    ranks = (logprobs >= target_logprob).sum(-1)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)
    ids = torch.cat((target, top_ids), dim=-1).to(torch.int32)
    return ids, torch.cat((target_logprob, top_values), dim=-1), ranks
