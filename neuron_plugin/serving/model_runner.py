"""One engine step: vLLM scheduler output -> backend calls -> sampled tokens.

A step's requests split into context-encoding calls (one per request with new prompt
tokens: a fresh prompt, a prefix-cache hit's remainder, a chunk, or a re-prefill after
preemption) and one token-generation call for every request decoding a single token.

Sampling: with on-device sampling (the default) each request is decided once, from its
`SamplingParams` alone (`core.sampling.on_device_refusal`): greedy, temperature, top-k
within global_topk and top-p come back from the backend as token ids; anything else
(logprobs, penalties, min-p, logit bias, a grammar, a seed, ...) brings its row's logits
back and is sampled by vLLM's own `Sampler`, so every option vLLM implements works
unchanged. A step whose rows are all device-sampled never builds a logits batch nor runs
the Sampler. In a mixed step the Sampler runs over the whole batch (its metadata, logits
processors and grammar bitmasks are indexed by batch row) with each device row's logits
replaced by a one-hot row of its device token and its metadata made greedy, so it returns
that token and the Sampler's cost follows the host rows' options alone (a
whole-vocabulary sort only when one of them uses top-k/top-p). With on-device sampling
off, every row's logits go through the Sampler.

Request bookkeeping follows vLLM's GPU runner contract (`InputBatch`,
`CachedRequestState`); the sequence slot of a request in the contiguous layout is its
single vLLM block id minus one, so the scheduler's allocator frees and reassigns slots
on finish, abort and preemption without a second allocator that could drift.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import LoadedBackend
from neuron_plugin.core.inputs import (
    ForwardInputs,
    context_encoding_inputs,
    token_generation_inputs,
)
from neuron_plugin.core.sampling import SAMPLING_EPS, SamplingInputs, on_device_refusal
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.serving.observers import FinishedRequest, StepObserver

logger = plugin_logger(__name__)


@dataclass
class _PendingStep:
    """What execute_model computed, waiting for sample_tokens (rows: batch order)."""

    scheduler_output: SchedulerOutput
    samples: np.ndarray  # bool: does this row produce a token now
    host: np.ndarray  # bool: vLLM's Sampler samples this row from `logits`
    logits: torch.Tensor  # [rows, vocab] float32 when any row is `host`, else [0, vocab]
    sampling: SamplingInputs | None  # with on-device sampling
    tokens: np.ndarray  # int32: the device's token (unused without on-device sampling)


@dataclass
class _Timeline:
    """When a request started and first produced a token, for FinishedRequest."""

    started: float
    prefix_hit_tokens: int
    bucket: list[int]
    first_token: float | None = None


class NeuronModelRunner:
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: NeuronSettings,
        backend: LoadedBackend,
        observers: Sequence[StepObserver] = (),
    ):
        self.vllm_config = vllm_config
        self.settings = settings
        self.backend = backend
        self.observers = tuple(observers)
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
        # Per request: why the host samples it (None: the device does).
        self._refusals: dict[str, str | None] = {}
        # The device rows' draws: one engine-wide stream, seeded like vLLM's.
        self._draws = np.random.default_rng(model_config.seed)
        self._pending: _PendingStep | None = None
        self._step_start = 0.0
        self._step_forward_s = 0.0
        self._timelines: dict[str, _Timeline] = {}

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
        return {
            f"model.layers.{i}.self_attn": spec for i in range(self.hf_config.num_hidden_layers)
        }

    # -- request state -------------------------------------------------------------
    def _new_state(self, data) -> CachedRequestState:
        params = data.sampling_params
        if self.settings.on_device_sampling:
            self._refusals[data.req_id] = on_device_refusal(params, self.settings.global_topk)
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
            self._refusals.pop(req_id, None)
            batch.remove_request(req_id)
            if state is not None:
                self._finish(state)
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
            del state.output_token_ids[cached.num_output_tokens[i] :]
            if req_id in resumed:
                if new_blocks is None:  # vLLM's runners assume it never is
                    raise RuntimeError(f"vLLM resumed request {req_id} without its KV blocks")
                state.block_ids = tuple(list(ids) for ids in new_blocks)
            elif new_blocks is not None:
                for ids, extra in zip(state.block_ids, new_blocks, strict=True):
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

    def _finish(self, state: CachedRequestState) -> None:
        timeline = self._timelines.pop(state.req_id, None)
        if timeline is None or not self.observers:
            return
        started = timeline.started
        request = FinishedRequest(
            prompt_tokens=state.num_prompt_tokens,
            output_tokens=len(state.output_token_ids),
            prefix_hit_tokens=timeline.prefix_hit_tokens,
            bucket=timeline.bucket,
            ttft_ms=round(1000 * ((timeline.first_token or started) - started), 3),
            duration_ms=round(1000 * (time.perf_counter() - started), 3),
        )
        for observer in self.observers:
            observer.on_request_finished(request)

    # -- one step --------------------------------------------------------------------
    def _seq_id(self, state: CachedRequestState, index: int) -> int:
        """Contiguous layout: one block per request (block_size == max_model_len) and
        vLLM's block 0 is its null block, so slots are block ids 1..max_num_seqs. The
        block layout addresses the cache through block tables; its seq id is the row."""
        if self.settings.is_block_layout:
            return index
        return state.block_ids[0][0] - 1

    def _run(
        self, inputs: ForwardInputs, rows: np.ndarray, step: _PendingStep, host_start: float
    ) -> None:
        """One backend call for batch rows `rows`: their tokens and needed logits into
        `step`."""
        forward_start = time.perf_counter()
        if step.sampling is None:
            logits = self.backend.forward(inputs)
            forward_s = time.perf_counter() - forward_start
            host = rows
        else:
            sampling = step.sampling.take(rows)
            out = self.backend.run(inputs, sampling)
            forward_s = time.perf_counter() - forward_start
            step.tokens[rows] = out.tokens
            host, logits = rows[sampling.needs_logits], out.logits
        self._step_forward_s += forward_s
        if host.size:
            step.logits[torch.from_numpy(host)] = logits
        for observer in self.observers:
            observer.on_backend_call(inputs, forward_s, forward_start - host_start)

    def _new_step(self, so: SchedulerOutput, samples: np.ndarray) -> _PendingStep:
        """Which rows the host samples, and the device rows' sampling values."""
        batch = self.input_batch
        n = batch.num_reqs
        if not self.settings.on_device_sampling:
            return _PendingStep(
                so,
                samples,
                np.ones(n, dtype=bool),
                torch.empty((n, self.vocab_size), dtype=torch.float32),
                None,
                np.zeros(n, dtype=np.int32),
            )
        host = np.fromiter(
            (self._refusals[r] is not None for r in batch.req_ids), dtype=bool, count=n
        )
        sampling = SamplingInputs.for_rows(
            batch.temperature_cpu[:n],
            batch.top_k_cpu[:n],
            batch.top_p_cpu[:n],
            host,
            self._draws.random(n, dtype=np.float32),
        )
        logits = torch.empty((n if host.any() else 0, self.vocab_size), dtype=torch.float32)
        return _PendingStep(so, samples, host, logits, sampling, np.zeros(n, dtype=np.int32))

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
        step = self._new_step(so, samples)

        # The decode batch runs first: its pad rows write into the cache lines of the
        # seq_ids it lacks, which must not yet hold a request prefilled in this step (a
        # sliding-window line is a rolling buffer with no position left unread).
        rows = np.flatnonzero(decoding)
        if rows.size:
            host_start = time.perf_counter()
            positions = computed[rows]
            states = [self.requests[req_ids[i]] for i in rows]
            inputs = token_generation_inputs(
                self.settings,
                batch.token_ids_cpu[rows, positions],
                positions,
                np.array(
                    [self._seq_id(s, int(i)) for s, i in zip(states, rows, strict=True)],
                    dtype=np.int64,
                ),
                [s.block_ids[0] for s in states] if self.settings.is_block_layout else None,
            )
            self._run(inputs, rows, step, host_start)

        for index in np.flatnonzero(~decoding):
            host_start = time.perf_counter()
            state = self.requests[req_ids[index]]
            start, count = int(computed[index]), int(scheduled[index])
            inputs = context_encoding_inputs(
                self.settings,
                batch.token_ids_cpu[index, : start + count],
                start,
                self._seq_id(state, int(index)),
                state.block_ids[0],
            )
            self._run(inputs, np.array([index]), step, host_start)
            if state.req_id not in self._timelines:
                self._timelines[state.req_id] = _Timeline(host_start, start, list(inputs.bucket))

        self._pending = step
        return None

    def _host_sample(
        self, pending: _PendingStep, grammar_output: GrammarOutput | None
    ) -> tuple[list[int], LogprobsTensors | None]:
        """vLLM's Sampler over the whole batch; device rows return their device token."""
        batch = self.input_batch
        logits = pending.logits
        metadata = batch.sampling_metadata
        if not pending.host.all():
            device = torch.from_numpy(np.flatnonzero(~pending.host))
            logits[device] = float("-inf")
            logits[device, torch.from_numpy(pending.tokens)[device].long()] = 0.0
            metadata = self._greedy_device_rows(metadata, pending.host)
        if grammar_output is not None:
            apply_grammar_bitmask(pending.scheduler_output, grammar_output, batch, logits)
        # A seeded request whose prefill is still partial must not consume a draw.
        kept = {i: g.get_state() for i, g in batch.generators.items() if not pending.samples[i]}
        sampler_output = self.sampler(logits, metadata)
        for index, state in kept.items():
            batch.generators[index].set_state(state)
        return (sampler_output.sampled_token_ids[:, 0].tolist(), sampler_output.logprobs_tensors)

    def _greedy_device_rows(self, metadata: SamplingMetadata, host: np.ndarray) -> SamplingMetadata:
        """The batch's metadata with the device rows greedy and without top-k/top-p (see
        the module docstring); the host rows' values are untouched."""
        if metadata.all_greedy or metadata.temperature is None:
            return metadata
        keep = torch.from_numpy(host)
        temperature = torch.where(keep, metadata.temperature, 0.0)
        random = bool((temperature >= SAMPLING_EPS).any())

        def host_only(values: torch.Tensor | None, off: float) -> torch.Tensor | None:
            if values is None:
                return None
            values = torch.where(keep, values, off)
            return values if bool((values != off).any()) else None

        return dataclasses.replace(
            metadata,
            temperature=temperature if random else None,
            all_greedy=not random,
            all_random=False,
            top_p=host_only(metadata.top_p, 1.0),
            top_k=host_only(metadata.top_k, self.vocab_size),
        )

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        if not pending.host.any():  # every row sampled on the device
            sampled, logprobs = pending.tokens.tolist(), None
        else:
            sampled, logprobs = self._host_sample(pending, grammar_output)
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
            timeline = self._timelines.get(req_id)
            if timeline is not None and timeline.first_token is None:
                timeline.first_token = time.perf_counter()
        output = ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=tokens,
            logprobs=logprobs.tolists() if logprobs is not None else None,
        )
        host_s = time.perf_counter() - self._step_start - self._step_forward_s
        for observer in self.observers:
            observer.on_step(host_s)
        return output
