"""The reference backend's prompt-logprob graph: a context encoding of the target that
also scores every prompt position (core.prompt_logprobs), with its k fixed at compile
time as a Neuron graph's would be."""

from __future__ import annotations

import torch
from torch import nn

from neuron_plugin.backends.reference.decoder import DecoderGraph


class PromptLogprobsGraph(nn.Module):
    """`DecoderGraph`'s context encoding with `prompt_targets` [1, active] after the KV
    caches; answers its usual outputs, then ids, logprobs [1, active, k + 1] and ranks."""

    def __init__(self, decoder: DecoderGraph, k: int):
        super().__init__()
        self.decoder = decoder
        self.k = k

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
        prompt_targets: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        temperature: torch.Tensor | None = None,
        uniform: torch.Tensor | None = None,
        lora_weights: list[torch.Tensor] | None = None,
        adapter_slots: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self.decoder(
            weights,
            input_ids,
            positions,
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
            lora_weights=lora_weights,
            adapter_slots=adapter_slots,
            prompt_targets=prompt_targets,
            prompt_k=self.k,
        )
