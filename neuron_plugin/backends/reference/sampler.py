"""The reference backend's on-device sampler: fixed-shape torch functions compiled into
every graph, with vLLM's semantics.

`sample` draws one token per row; `verify` picks the tokens a speculative decode emits
(core.speculation), with vLLM's rejection sampling (v1/sample/rejection_sampler.py), so a
sampled request keeps its distribution under speculation. Random draws are inputs made
on the host (one uniform per row and position), so the graphs hold no random operator.
"""

from __future__ import annotations

import torch

NO_TOKEN = -1  # core.speculation.NO_TOKEN (this module runs inside the graphs)


def candidate_probs(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    temperature: torch.Tensor,
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [rows, candidates], token ids [rows, candidates]) of each row's
    sampling distribution: the `candidates` (global_topk) largest logits divided by the
    temperature, cut to the row's top-k (ties with the k-th value stay, as in vLLM) and to
    its top-p (a token stays while the probability before it is below top_p, vLLM's rule;
    NxDI's sampler also drops the token that crosses top_p), not renormalised (callers
    draw by inverse CDF against the kept total)."""
    values, indices = torch.topk(logits, candidates, dim=-1)
    kth = values.gather(-1, top_k.clamp(1, candidates).long().unsqueeze(-1) - 1)
    scaled = (values / temperature.unsqueeze(-1)).masked_fill(values < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    before = probs.cumsum(-1) - probs
    return probs.masked_fill(before >= top_p.unsqueeze(-1), 0.0), indices


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index [rows] drawn from each row's (unnormalised) `probs` with its uniform number.
    Float rounding may land past the last positive entry: it is clamped there."""
    cumulative = probs.cumsum(-1)
    drawn = (cumulative <= uniform.unsqueeze(-1) * cumulative[:, -1:]).sum(-1)
    positions = torch.arange(probs.shape[-1], dtype=drawn.dtype)
    last = (positions * (probs > 0)).amax(-1)
    return torch.minimum(drawn, last)


def draw(probs: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token id [rows] each row's uniform number draws from (`probs`, `ids`) of
    `candidate_probs`."""
    return ids.gather(-1, inverse_cdf(probs, uniform).unsqueeze(-1)).squeeze(-1)


def sample(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    candidates: int,
) -> torch.Tensor:
    """One token per row [rows] with vLLM's sampling semantics. Rows with top_k 1 take
    the argmax of the logits (vLLM's greedy); the others draw from `candidate_probs` by
    inverse CDF with the row's uniform number [rows]: one random input per row, made on
    the host, so a row's draw costs 4 bytes across the runner's seam."""
    greedy = logits.max(dim=-1).indices
    probs, indices = candidate_probs(logits, top_k, top_p, temperature, candidates)
    return torch.where(top_k == 1, greedy, draw(probs, indices, uniform))


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    budget: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    candidates: int,
) -> torch.Tensor:
    """The tokens a speculative decode emits [rows, width], padded with NO_TOKEN.

    `logits` [rows, width, vocab] are the target's after the last token and after each
    draft, `drafts` [rows, width - 1] the proposals (greedy draft-model or n-gram tokens:
    a draft probability of 1), `budget` [rows] how many drafts a row may accept,
    `uniform` [rows, width] one draw per position. vLLM's rule: a greedy row (top_k 1)
    accepts a draft equal to the target's argmax; a sampled row accepts draft x at
    position j when uniform[j] <= p_j(x), and on rejection draws from p_j without x,
    reusing the rejected draw's remainder (uniform - p) / (1 - p), which is uniform given
    the rejection. A row emits its accepted drafts, then the target's correction at the
    first rejection, or the bonus token (an ordinary draw at the next position) when every
    draft within its budget was accepted."""
    rows, width, vocab = logits.shape
    flat = logits.reshape(rows * width, vocab)
    each = lambda t: t.repeat_interleave(width)  # noqa: E731 (per row -> per position)
    top_k_, top_p_, temperature_ = each(top_k), each(top_p), each(temperature)
    draws = uniform.reshape(-1)
    greedy = flat.max(dim=-1).indices
    probs, indices = candidate_probs(flat, top_k_, top_p_, temperature_, candidates)
    ordinary = torch.where(top_k_ == 1, greedy, draw(probs, indices, draws))

    # The draft each position verifies (the last position verifies none).
    proposed = torch.cat((drafts, drafts[:, :1]), dim=1).reshape(-1)
    is_draft = indices == proposed.unsqueeze(-1)
    kept = probs.sum(-1)
    hit = (probs * is_draft).sum(-1)
    p_draft = hit / kept
    accepted = torch.where(top_k_ == 1, proposed == greedy, (draws <= p_draft) & (hit > 0))
    # (u - p) / (1 - p), with p = hit / kept
    remainder = ((draws - p_draft) * kept / (kept - hit).clamp(min=1e-12)).clamp(0.0, 1.0)
    residual = draw(probs.masked_fill(is_draft, 0.0), indices, remainder)
    correction = torch.where(top_k_ == 1, greedy, residual).reshape(rows, width)

    position = torch.arange(width).unsqueeze(0)
    within = position < budget.unsqueeze(-1)
    rejected = (~accepted.reshape(rows, width) | ~within).long()
    run = (rejected.cumsum(-1) == 0).sum(-1, keepdim=True)  # leading accepted drafts
    stop = torch.where(run < budget.unsqueeze(-1), correction, ordinary.reshape(rows, width))
    emitted = torch.where(position < run, proposed.reshape(rows, width), stop)
    return torch.where(position <= run, emitted, torch.full_like(emitted, NO_TOKEN))
