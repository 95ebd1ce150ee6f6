"""One engine step: vLLM scheduler output -> backend calls -> sampled tokens.

A step's requests split into context-encoding calls (one per request with new prompt
tokens: a fresh prompt, a prefix-cache hit's remainder, a chunk, or a re-prefill after
preemption) and one token-generation call for every request decoding a single token.
Logits are gathered in vLLM's persistent-batch order and sampled on the host by vLLM's
own `Sampler`, so every `SamplingParams` option vLLM implements works unchanged.

Request bookkeeping follows vLLM's GPU runner contract (`InputBatch`,
`CachedRequestState`); the sequence slot of a request in the contiguous layout is its
single vLLM block id minus one, so the scheduler's allocator frees and reassigns slots
on finish, abort and preemption without a second allocator that could drift.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from neuron_plugin.backends.base import Backend
from neuron_plugin.config import NeuronSettings
from neuron_plugin.inputs import (
    ForwardInputs,
    context_encoding_inputs,
    token_generation_inputs,
)
from neuron_plugin.telemetry import RequestTrace, StepTelemetry
from neuron_plugin import plugin_logger

logger = plugin_logger(__name__)


@dataclass
class _PendingStep:
    """Logits computed by execute_model, waiting for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor
    samples: np.ndarray  # bool per batch row: does this row produce a token now


class NeuronModelRunner:
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, settings: NeuronSettings,
                 backend: Backend, telemetry: StepTelemetry):
        self.vllm_config = vllm_config
        self.settings = settings
        self.backend = backend
        self.telemetry = telemetry
        model_config = vllm_config.model_config
        self.vocab_size = model_config.get_vocab_size()
        self.hf_config = model_config.hf_text_config
        self.requests: dict[str, CachedRequestState] = {}
        device = torch.device("cpu")
        self.input_batch = InputBatch(
            max_num_reqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            device=device,
            vocab_size=self.vocab_size,
            block_sizes=[settings.block_size],
            max_num_blocks_per_req=[settings.max_blocks_per_seq],
            logitsprocs=build_logitsprocs(vllm_config, device, False, False, ()),
            is_pooling_model=False,
        )
        self.sampler = Sampler(logprobs_mode=model_config.logprobs_mode)
        self._pending: _PendingStep | None = None
        self._step_start = 0.0
        self._step_forward_s = 0.0
        self.trace = RequestTrace.from_env()
        self._traced: dict[str, dict] = {}

    # -- KV cache spec -------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer; the backend owns the actual tensors."""
        dtype = getattr(torch, self.settings.dtype)
        spec = FullAttentionSpec(
            block_size=self.settings.block_size,
            num_kv_heads=self.hf_config.num_key_value_heads,
            head_size=getattr(self.hf_config, "head_dim", None)
            or self.hf_config.hidden_size // self.hf_config.num_attention_heads,
            dtype=dtype,
        )
        return {f"model.layers.{i}.self_attn": spec
                for i in range(self.hf_config.num_hidden_layers)}

    # -- request state -------------------------------------------------------------
    def _new_state(self, data) -> CachedRequestState:
        params = data.sampling_params
        generator = None
        if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed)
        return CachedRequestState(
            req_id=data.req_id,
            prompt_token_ids=data.prompt_token_ids,
            mm_features=data.mm_features,
            sampling_params=params,
            generator=generator,
            block_ids=tuple(list(ids) for ids in data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            output_token_ids=[],
            lora_request=data.lora_request,
        )

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply finished / new / resumed / running requests to the persistent batch."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            if self.trace is not None and state is not None:
                self._write_trace(state)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        scheduled = so.num_scheduled_tokens.keys()
        for req_id in batch.req_id_to_index.keys() - (scheduled - resumed):
            batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for data in so.scheduled_new_reqs:
            state = self._new_state(data)
            self.requests[data.req_id] = state
            to_add.append(state)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            # Output tokens beyond what the scheduler kept were discarded.
            del state.output_token_ids[cached.num_output_tokens[i]:]
            if req_id in resumed:
                state.block_ids = tuple(list(ids) for ids in new_blocks)
            elif new_blocks is not None:
                for ids, extra in zip(state.block_ids, new_blocks):
                    ids.extend(extra)
            index = batch.req_id_to_index.get(req_id)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            batch.num_tokens_no_spec[index] = state.num_tokens
            if new_blocks is not None:
                batch.block_table.append_row(new_blocks, index)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _write_trace(self, state: CachedRequestState) -> None:
        """One JSONL record per finished request, in the fields neuron-buckets reads."""
        info = self._traced.pop(state.req_id, None)
        if info is None:
            return
        started = info["started"]
        self.trace.write({
            "prompt_tokens": state.num_prompt_tokens,
            "output_tokens": len(state.output_token_ids),
            "prefix_hit_tokens": info["prefix_hit_tokens"],
            "bucket": info["bucket"],
            "ttft_ms": round(1000 * (info.get("first_token", started) - started), 3),
            "duration_ms": round(1000 * (time.perf_counter() - started), 3),
        })

    # -- one step --------------------------------------------------------------------
    def _seq_id(self, state: CachedRequestState, index: int) -> int:
        """Contiguous layout: one block per request (block_size == max_model_len) and
        vLLM's block 0 is its null block, so slots are block ids 1..max_num_seqs. The
        block layout addresses the cache through block tables; its seq id is the row."""
        if self.settings.is_block_layout:
            return index
        return state.block_ids[0][0] - 1

    def _run(self, inputs: ForwardInputs, host_start: float) -> torch.Tensor:
        forward_start = time.perf_counter()
        logits = self.backend.forward(inputs)
        forward_s = time.perf_counter() - forward_start
        self._step_forward_s += forward_s
        self.telemetry.record_call(inputs, forward_s, forward_start - host_start)
        return logits

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self._step_start = time.perf_counter()
        self._step_forward_s = 0.0
        self.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids
        scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        total = batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        samples = computed + scheduled >= total
        decoding = (scheduled == 1) & (computed > 0)
        logits = torch.zeros((num_reqs, self.vocab_size), dtype=torch.float32)

        for index in np.flatnonzero(~decoding):
            host_start = time.perf_counter()
            state = self.requests[req_ids[index]]
            start, count = int(computed[index]), int(scheduled[index])
            inputs = context_encoding_inputs(
                self.settings, batch.token_ids_cpu[index, :start + count], start,
                self._seq_id(state, int(index)), state.block_ids[0])
            logits[index] = self._run(inputs, host_start)[0]
            if self.trace is not None:
                self._traced.setdefault(state.req_id, {
                    "prefix_hit_tokens": start, "bucket": list(inputs.bucket),
                    "started": host_start})

        rows = np.flatnonzero(decoding)
        if rows.size:
            host_start = time.perf_counter()
            positions = computed[rows]
            states = [self.requests[req_ids[i]] for i in rows]
            inputs = token_generation_inputs(
                self.settings, batch.token_ids_cpu[rows, positions], positions,
                np.array([self._seq_id(s, int(i)) for s, i in zip(states, rows)], dtype=np.int64),
                [s.block_ids[0] for s in states] if self.settings.is_block_layout else None)
            logits[rows] = self._run(inputs, host_start)

        self._pending = _PendingStep(so, logits, samples)
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        logits = pending.logits
        if grammar_output is not None:
            apply_grammar_bitmask(pending.scheduler_output, grammar_output, batch, logits)
        # A seeded request whose prefill is still partial must not consume a draw.
        kept = {i: g.get_state() for i, g in batch.generators.items()
                if not pending.samples[i]}
        sampler_output = self.sampler(logits, batch.sampling_metadata)
        for index, state in kept.items():
            batch.generators[index].set_state(state)
        sampled = sampler_output.sampled_token_ids[:, 0].tolist()
        tokens: list[list[int]] = []
        for index, req_id in enumerate(batch.req_ids):
            if not pending.samples[index]:
                tokens.append([])
                continue
            token = sampled[index]
            end = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, end] = token
            batch.is_token_ids[index, end] = True
            batch.num_tokens_no_spec[index] = end + 1
            self.requests[req_id].output_token_ids.append(token)
            tokens.append([token])
            if self.trace is not None and req_id in self._traced:
                self._traced[req_id].setdefault("first_token", time.perf_counter())
        logprobs = sampler_output.logprobs_tensors
        output = ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=tokens,
            logprobs=logprobs.tolists() if logprobs is not None else None,
        )
        self.telemetry.record_step_host(
            time.perf_counter() - self._step_start - self._step_forward_s)
        return output
