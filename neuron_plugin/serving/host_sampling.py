"""vLLM's Sampler over the rows the host samples, and only those.

A request is host-sampled for its whole life or never (`core.sampling.on_device_refusal`
decides once from its `SamplingParams`; with on-device sampling off every request is).
So the host rows get a persistent batch of their own: a second vLLM `InputBatch` that
holds exactly the host-sampled requests of the model runner's batch, added, removed and
condensed with it. vLLM's own code then restricts everything the Sampler reads to those
rows: `SamplingMetadata` (temperature, top-k/top-p, penalties and their prompt-token
tensor, per-request generators, logprobs, allowed-token mask, bad words), the logits
processors (min-p, logit bias, min-tokens: built for this batch, so their per-row state
is indexed by its rows) and the grammar bitmask (`apply_grammar_bitmask` orders it by
this batch's rows). Device rows never enter it: a step with one logprobs row among 32
runs the Sampler over one row of logits.

Results go back into the step in the model runner's row order: tokens by row, logprobs
reordered to the host rows' order in the step's batch and addressed through vLLM's
`LogprobsLists.cu_num_generated_tokens` (a device row generates no logprobs row).

The Sampler runs vLLM's PyTorch code on every vLLM build (`HostRowsSampler`). vLLM picks
its sampling kernels from the platform: on a CPU platform (this one: every tensor vLLM
holds here is a host tensor) `Sampler.greedy_sample` calls `torch.ops._C.greedy_argmax`
and `TopKTopPSampler` takes `forward_cpu`, which calls `torch.ops._C.fused_gumbel_argmax`
(`v1/sample/sampler.py`, `v1/sample/ops/topk_topp_sampler.py`, vLLM 0.32 and 0.33): ops
that only the CPU build's `_C` library registers. The `vllm` wheel, which Neuron hosts
install, has no such library, and its `apply_top_k_top_p` prefers Triton kernels
wherever Triton reports a driver. So greedy rows take `argmax`, and sampled rows vLLM's
PyTorch top-k/top-p (`apply_top_k_top_p_pytorch`), softmax and `random_sample` (its
exponential-race draw from each request's own generator): one path, so a seeded request
gets the same tokens on the CPU build and on the wheel.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.model import LogprobsMode
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import LogprobsLists, LogprobsTensors
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch, random_sample
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.serving.vllm_compat import first_bitmask_rows


class HostRowsSampler(Sampler):
    """vLLM's Sampler on its PyTorch paths, whatever the build (see the module
    docstring): everything but the final draw is vLLM's own code."""

    def __init__(self, logprobs_mode: LogprobsMode):
        super().__init__(logprobs_mode=logprobs_mode)
        # TopKTopPSampler binds its own pick to `forward` in its __init__ the same way.
        self.topk_topp_sampler.forward = self._top_k_top_p_sample

    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1).view(-1)

    def _top_k_top_p_sample(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`TopKTopPSampler.forward_native` with the PyTorch top-k/top-p (host tensors
        sync for free, which lets top-k alone skip the full sort)."""
        sampler = self.topk_topp_sampler
        logits = apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        processed = None
        if sampler.logprobs_mode == "processed_logits":
            processed = logits
        elif sampler.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return random_sample(probs, generators, sampler.use_fp64_gumbel), processed


class HostSampler:
    """The host-sampled requests' persistent batch and vLLM's Sampler over it."""

    def __init__(self, vllm_config: VllmConfig, settings: NeuronSettings, vocab_size: int):
        device = torch.device("cpu")
        self.batch = InputBatch(
            max_num_reqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            device=device,
            vocab_size=vocab_size,
            block_sizes=[settings.block_size],
            max_num_blocks_per_req=[settings.max_blocks_per_seq],
            logitsprocs=build_logitsprocs(vllm_config, device, False, False, ()),
            is_pooling_model=False,
        )
        self.sampler = HostRowsSampler(vllm_config.model_config.logprobs_mode)

    # -- membership, mirroring the model runner's batch -------------------------------
    def add(self, state: CachedRequestState) -> None:
        self.batch.add_request(state)

    def remove(self, req_id: str) -> None:
        self.batch.remove_request(req_id)

    def refresh(self) -> None:
        """After a step's adds and removes: close the gaps, update the logits
        processors' state and the sampling metadata (vLLM's order)."""
        self.batch.condense()
        self.batch.refresh_metadata()

    @property
    def num_rows(self) -> int:
        return self.batch.num_reqs

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """This batch's row of each request (all host-sampled)."""
        index = self.batch.req_id_to_index
        return np.fromiter((index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    # -- one step ------------------------------------------------------------------------
    def sample(
        self,
        logits: torch.Tensor,
        samples: np.ndarray,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None,
    ) -> tuple[np.ndarray, LogprobsTensors | None]:
        """Tokens [rows] and logprobs for this batch's rows from their `logits`
        [rows, vocab] (this batch's order; modified in place). A row whose `samples` is
        false (a prefill chunk that is not the last) is sampled and discarded, and its
        seeded generator is rewound, as in vLLM's GPU runner."""
        batch = self.batch
        if grammar_output is not None:
            apply_grammar_bitmask(
                *_first_positions(scheduler_output, grammar_output), batch, logits
            )
        kept = {i: g.get_state() for i, g in batch.generators.items() if not samples[i]}
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(threads, len(samples))))
        try:
            output = self.sampler(logits, batch.sampling_metadata)
        finally:
            torch.set_num_threads(threads)
        for index, state in kept.items():
            batch.generators[index].set_state(state)
        return output.sampled_token_ids[:, 0].numpy(), output.logprobs_tensors


def _first_positions(
    scheduler_output: SchedulerOutput, grammar_output: GrammarOutput
) -> tuple[SchedulerOutput, GrammarOutput]:
    """The grammar bitmask of each request's first position: a host row takes no drafts,
    but vLLM may still send bitmask rows for drafts (it pads a short request to the
    speculative length; 0.33 always sends the speculative length's rows)."""
    ids = grammar_output.structured_output_request_ids
    bitmask = grammar_output.grammar_bitmask
    if bitmask.shape[0] == len(ids):
        return scheduler_output, grammar_output
    spec = scheduler_output.scheduled_spec_decode_tokens
    firsts = first_bitmask_rows(ids, spec, bitmask.shape[0])
    return (
        dataclasses.replace(scheduler_output, scheduled_spec_decode_tokens={}),
        dataclasses.replace(grammar_output, grammar_bitmask=bitmask[firsts]),
    )


def logprobs_in_step_order(
    logprobs: LogprobsTensors, host_rows: np.ndarray, is_host: np.ndarray
) -> LogprobsLists:
    """The host batch's logprobs as the step's `LogprobsLists`: rows reordered to the
    step's order of its host rows (`host_rows[j]`: the host-batch row of the step's j-th
    host row), and `cu_num_generated_tokens[i]` the first of step row i's logprobs rows
    (`is_host`: the step's rows; a device row has none)."""
    count = len(host_rows)
    order = torch.from_numpy(host_rows)

    def reordered(t: torch.Tensor) -> torch.Tensor:
        # num_logprobs=-1 carries empty ids and ranks: nothing to reorder there.
        return t[order] if t.dim() and t.shape[0] == count else t

    cu = np.concatenate([[0], np.cumsum(is_host, dtype=np.int64)])
    return LogprobsTensors(
        reordered(logprobs.logprob_token_ids),
        reordered(logprobs.logprobs),
        reordered(logprobs.selected_token_ranks),
    ).tolists(cu.tolist())
