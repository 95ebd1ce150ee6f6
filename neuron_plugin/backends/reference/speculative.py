"""The reference backend's speculative-decoding graphs (core.speculation), built from the
target decoder's pieces (`DecoderGraph.hidden`, `.head`) and the sampler's `verify`.

- `VerifyGraph` (n-gram): one call computes the target at the last token and every
  host-proposed draft of each row ([batch, speculation_length] inputs) and returns the
  tokens the row emits.
- `FusedDraftGraph` (draft model, NxDI's fused speculation): one token per row in; the
  draft decodes speculation_length times (each draft at the next position; the last run
  only writes the draft's KV for the last draft, as NxDI's draft loop does,
  model_base.py `_token_gen_forward`), then the target verifies the drafts as above.
- `DraftPrefillGraph`: a context encoding that also encodes the prompt with the draft,
  so the draft's KV cache mirrors the target's (NxDI `_context_encoding_forward`).

The draft's KV cache has the target's slot geometry (same slots, its own layers and
heads), so block tables, prefix-cache hits and preemption apply to both alike. Every
graph answers (logits of the first position [batch, vocab], for rows the host samples,
and tokens [batch, speculation_length] padded with NO_TOKEN; a context encoding's tokens
are [batch]).
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_plugin.backends.reference.decoder import DecoderGraph
from neuron_plugin.backends.reference.sampler import verify


class VerifyGraph(nn.Module):
    """Target verification of host-proposed drafts (see the module docstring).
    `last_index` is each row's draft budget (its last kept position)."""

    def __init__(self, target: DecoderGraph):
        super().__init__()
        self.target = target

    def forward(
        self,
        weights: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        last_index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.target
        w = target.named(weights)
        x = target.hidden(
            w, input_ids, positions, write_slots, read_slots, full_context_lens, k_cache, v_cache
        )
        logits = target.head(w, x)
        assert target.candidates is not None  # speculation needs on-device sampling
        tokens = verify(
            logits,
            input_ids[:, 1:],
            last_index,
            top_k,
            top_p,
            temperature,
            uniform,
            target.candidates,
        )
        return logits[:, 0], tokens


class FusedDraftGraph(nn.Module):
    """Draft proposals and their verification in one graph (see the module docstring).
    `write_slots` [batch, speculation_length] are the cache slots of the positions the
    call computes (scratch past a row's budget), `last_index` each row's draft budget."""

    def __init__(self, target: DecoderGraph, draft: DecoderGraph, width: int):
        super().__init__()
        self.verifier = VerifyGraph(target)
        self.draft = draft
        self.width = width

    def forward(
        self,
        weights: list[torch.Tensor],
        draft_weights: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        last_index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        draft_k_cache: torch.Tensor,
        draft_v_cache: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        draft = self.draft
        dw = draft.named(draft_weights)
        start = positions[:, :1]
        token = input_ids[:, :1]
        candidates = [token]
        for i in range(self.width):
            x = draft.hidden(
                dw,
                token,
                start + i,
                write_slots[:, i : i + 1],
                read_slots,
                start[:, 0] + i + 1,
                draft_k_cache,
                draft_v_cache,
            )
            if i + 1 < self.width:  # the last run only writes the last draft's KV
                token = draft.head(dw, x[:, 0]).max(dim=-1).indices.unsqueeze(-1)
                candidates.append(token)
        proposed = torch.cat(candidates, dim=1)
        return self.verifier(
            weights,
            proposed,
            start + torch.arange(self.width).unsqueeze(0),
            write_slots,
            read_slots,
            full_context_lens,
            last_index,
            k_cache,
            v_cache,
            top_k,
            top_p,
            temperature,
            uniform,
        )


class DraftPrefillGraph(nn.Module):
    """A context encoding of the target (its usual answer) that also writes the draft's
    KV cache for the same tokens."""

    def __init__(self, target: DecoderGraph, draft: DecoderGraph):
        super().__init__()
        self.target = target
        self.draft = draft

    def forward(
        self,
        weights: list[torch.Tensor],
        draft_weights: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        last_index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        draft_k_cache: torch.Tensor,
        draft_v_cache: torch.Tensor,
        *sampling: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`sampling`: the target's sampler inputs (top_k, top_p, temperature, uniform)."""
        self.draft.hidden(
            self.draft.named(draft_weights),
            input_ids,
            positions,
            write_slots,
            read_slots,
            full_context_lens,
            draft_k_cache,
            draft_v_cache,
        )
        return self.target(
            weights,
            input_ids,
            positions,
            write_slots,
            read_slots,
            full_context_lens,
            last_index,
            k_cache,
            v_cache,
            *sampling,
        )
