"""Speculative decoding on the model runner's side of vLLM's contract (core.speculation).

vLLM's scheduler asks the worker for each request's next drafts after every step
(`take_draft_token_ids`), schedules them as extra tokens of the request (KV slots
included: `scheduled_spec_decode_tokens`), and rolls back the ones the step's output
did not accept. So:
- n-gram: the drafts are vLLM's own `NgramProposer`'s, computed from the tokens the step
  emitted (appended to the batch first), and the decode call verifies them;
- draft model: the graph proposes its own drafts, so the runner hands vLLM placeholders
  (-1, as vLLM's async scheduler does) for the draft positions the graph will compute;
  vLLM still allocates their KV slots and counts what the step accepts.
A host-sampled request gets no drafts (its logits leave the device for one position).
A draft vLLM pads with -1 (it pads a short request to the speculative length) is never
accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from vllm.config import VllmConfig
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.worker.gpu_input_batch import InputBatch

from neuron_plugin.core.neuron_settings import NGRAM
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.speculation import NO_TOKEN

if TYPE_CHECKING:
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer


class Drafts:
    """The next step's drafts (none without speculative decoding)."""

    def __init__(self, settings: NeuronSettings, proposer: NgramProposer | None = None):
        self.method = settings.speculation_method
        self.count = settings.num_speculative_tokens
        self.proposer = proposer
        self._next: DraftTokenIds | None = None

    @classmethod
    def for_settings(cls, vllm_config: VllmConfig, settings: NeuronSettings) -> Drafts:
        if settings.speculation_method != NGRAM:
            return cls(settings)
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        proposer = NgramProposer(vllm_config)
        # Its constructor's warm-up never compiles the matcher (numba): a first request
        # would wait seconds for it. One real row here does.
        lookup = proposer.max_n + 1
        history = np.tile(np.arange(lookup, dtype=np.int32), 2)[None, :]
        proposer.propose(
            settings.num_speculative_tokens,
            [[0]],
            np.array([history.shape[1]], dtype=np.int32),
            np.pad(history, ((0, 0), (0, settings.max_model_len - history.shape[1]))),
        )
        return cls(settings, proposer)

    def scheduled(
        self, lists: Sequence[Sequence[int]], host: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The decode rows' scheduled drafts as the call carries them: (n-gram drafts
        [rows, num_speculative_tokens], -1 where none; None with a fused draft model)
        and each row's budget, the drafts it may accept (leading real n-gram drafts, or
        the placeholders vLLM kept; 0 for host rows); (None, None) without speculation."""
        if self.method is None:
            return None, None
        if self.method != NGRAM:
            budget = np.array([len(d) for d in lists], dtype=np.int64)
            return None, np.where(host, 0, budget)
        drafts = np.full((len(lists), self.count), NO_TOKEN, dtype=np.int64)
        for row, given in enumerate(lists):
            drafts[row, : len(given)] = given
        real = np.cumprod(drafts >= 0, axis=1).sum(axis=1)
        return drafts, np.where(host, 0, real)

    def propose(self, batch: InputBatch, emitted: list[list[int]], host: np.ndarray) -> None:
        """The drafts for the step after the one that emitted `emitted` (per batch row,
        already appended to `batch`): none for host rows and rows that emitted nothing."""
        if self.method is None:
            return
        sampled = [[] if h else tokens for tokens, h in zip(emitted, host, strict=True)]
        if self.proposer is not None:
            drafts = self.proposer.propose(
                self.count, sampled, batch.num_tokens_no_spec, batch.token_ids_cpu
            )
        else:
            drafts = [[NO_TOKEN] * self.count if tokens else [] for tokens in sampled]
        self._next = DraftTokenIds(list(batch.req_ids), drafts)

    def take(self) -> DraftTokenIds | None:
        drafts, self._next = self._next, None
        return drafts
