"""One engine step: vLLM scheduler output -> backend calls -> sampled tokens.

A step's requests split into context-encoding calls (one per request with new prompt
tokens: a fresh prompt, a prefix-cache hit's remainder, a chunk, or a re-prefill after
preemption) and one token-generation call for every request decoding a single token.

Sampling: with on-device sampling (the default) each request is decided once, from its
`SamplingParams` alone (`core.sampling.on_device_refusal`): greedy, temperature, top-k
(none, or above global_topk: clamped to global_topk unless exact_sampling) and top-p come
back from the backend as token ids; anything else
(logprobs, penalties, min-p, logit bias, a grammar, a seed, ...) brings its row's logits
back and is sampled by vLLM's own `Sampler`, so every option vLLM implements works
unchanged. A step whose rows are all device-sampled never builds a logits batch nor runs
the Sampler. In a mixed step the Sampler runs over the host rows alone
(`serving.host_sampling`: a persistent vLLM `InputBatch` of the host-sampled requests,
with their own metadata, logits processors and grammar bitmask rows); device rows never
enter it, and the results are merged back in row order. With on-device sampling off,
every row is a host row.

Async scheduling (vLLM 0.32's contract, on with on-device sampling): `sample_tokens`
returns a promise (`steps.AsyncStepOutput`) and the step's last backend call is only
submitted; the step completes (the call collected, its host rows sampled, its tokens
appended to the batch, its output built) when vLLM asks for the output or at the start
of the next `execute_model`, whichever comes first, once, under a lock (vLLM's
multiprocess executor reads outputs from another thread). So the engine schedules step
N+1 and processes step N-1's output while the backend computes step N, and the batch
never holds placeholder tokens: step N's are real before step N+1's state updates.

Speculative decoding (`--speculative-config`, core.speculation): vLLM schedules each
decoding request's drafts as extra tokens (`scheduled_spec_decode_tokens`); the decode
call verifies them (n-gram drafts as inputs; a fused draft model proposes its own) and
each row emits its accepted drafts and one token of the target's, all appended to the
batch; vLLM rolls back what was not accepted. `serving.drafts` proposes the next step's
drafts, which vLLM takes through `take_draft_token_ids`. Host-sampled rows take no
drafts.

LoRA: each step first gets its rows' adapters into slots (`serving.adapters.AdapterStore.
prepare_step`, after the previous step's backend call completed) and every call carries
each row's slot; rows without an adapter use the base model's zero slot 0. A row whose
adapter could not be written takes no part in the step's calls, emits no token, and is
listed with the reason on the step's output, so vLLM's scheduler ends that request with
an error (`serving.request_errors`); the other rows run as usual.

Request bookkeeping follows vLLM's GPU runner contract (`InputBatch`,
`CachedRequestState`); the sequence slot of a request in the contiguous layout is its
single vLLM block id minus one, so the scheduler's allocator frees and reassigns slots
on finish, abort and preemption without a second allocator that could drift.

With a KV connector (prefill/decode disaggregation) every step makes vLLM's connector
calls (`serving.kv_steps`): loads at the start of `execute_model`, when no backend call
is in flight, and saves when the step completes, before its output leaves the worker;
steps without scheduled tokens make them too.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    DraftTokenIds,
    LogprobsLists,
    ModelRunnerOutput,
)
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import LoadedBackend, StepOutput
from neuron_plugin.core.adapters import AdapterError, row_slots
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    ForwardInputs,
    context_encoding_inputs,
    decode_width,
    token_generation_inputs,
)
from neuron_plugin.core.prompt_logprobs import prompt_targets, scored_positions
from neuron_plugin.core.recurrent_state import state_geometry
from neuron_plugin.core.sampling import SamplingInputs, on_device_refusal
from neuron_plugin.core.seq_slots import SeqSlots
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.speculation import NO_TOKEN
from neuron_plugin.serving.adapters import AdapterStore
from neuron_plugin.serving.drafts import Drafts
from neuron_plugin.serving.host_sampling import HostSampler, logprobs_in_step_order
from neuron_plugin.serving.images import Images
from neuron_plugin.serving.kv_steps import KVTransferSteps
from neuron_plugin.serving.observers import FinishedRequest, StepObserver
from neuron_plugin.serving.prompt_logprobs import PromptScores
from neuron_plugin.serving.request_errors import RunnerOutput, can_fail_requests
from neuron_plugin.serving.state_blocks import StateBlocks
from neuron_plugin.serving.steps import AsyncStepOutput, BackendCall, PendingStep

logger = plugin_logger(__name__)


@dataclass
class _Timeline:
    """When a request started and first produced a token, for FinishedRequest."""

    started: float
    prefix_hit_tokens: int
    bucket: list[int]
    first_token: float | None = None
    # Its decode steps and the rows they held in all (its mean decode batch).
    decode_steps: int = 0
    decode_rows: int = 0


class NeuronModelRunner:
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: NeuronSettings,
        backend: LoadedBackend,
        observers: Sequence[StepObserver] = (),
        async_scheduling: bool = False,
        adapters: AdapterStore | None = None,
    ):
        self.vllm_config = vllm_config
        # vLLM's async scheduling contract: sample_tokens returns a promise, and the
        # step's last backend call runs while the engine schedules the next step.
        self.async_scheduling = async_scheduling
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
            is_pooling_model=False,  # no logits processors: the host batch has them
        )
        self.host = HostSampler(vllm_config, settings, self.vocab_size)
        # Per request: why the host samples it (None: the device does).
        self._refusals: dict[str, str | None] = {}
        # The device rows' draws: one engine-wide stream, seeded like vLLM's.
        self._draws = np.random.default_rng(model_config.seed)
        self._pending: PendingStep | None = None  # executed, not yet sampled
        self._in_flight: PendingStep | None = None  # sampled, not yet complete
        self._complete_lock = threading.Lock()
        self._timelines: dict[str, _Timeline] = {}
        # Contiguous layout: each running request's cache line, the lowest free one
        # (core.seq_slots); None in the block layout, whose seq_id is the batch row.
        self._slots = None if settings.is_block_layout else SeqSlots(settings.max_num_seqs)
        # Speculative decoding: the next step's drafts (serving.drafts).
        self.drafts = Drafts.for_settings(vllm_config, settings)
        # LoRA: the adapters on the host and in the backend's slots (None: LoRA off).
        self.adapters = adapters
        # vLLM's KV connector (prefill/decode disaggregation), set by the worker.
        self.kv_transfer: KVTransferSteps | None = None
        # Requests scoring their prompt (prompt_logprobs), until it is encoded.
        self.prompt_scores = PromptScores()
        # A vision-language model's images (serving.images); None for a text model.
        self.images = (
            Images(backend, model_config.hf_config.to_dict(), observers)
            if settings.vision_buckets
            else None
        )
        # A hybrid model's state blocks (serving.state_blocks); None for other models.
        geometry = state_geometry(model_config.hf_config.to_dict())
        self.state = None if geometry is None else StateBlocks(settings, geometry)

    # -- KV cache spec -------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer, at the widest layer's geometry (vLLM's
        get_head_size and get_total_num_kv_heads; Gemma 4's layer types differ): the
        backend owns the actual tensors, and the block count is the settings' (the
        worker's determine_available_memory), so one block table serves every layer."""
        model_config = self.vllm_config.model_config
        spec = FullAttentionSpec(
            block_size=self.settings.block_size,
            num_kv_heads=model_config.get_total_num_kv_heads(),
            head_size=model_config.get_head_size(),
            dtype=getattr(torch, self.settings.dtype),
        )
        if self.state is not None:  # a hybrid model: its state layers' too
            return self.state.kv_cache_spec(spec)
        return {
            f"model.layers.{i}.self_attn": spec for i in range(self.hf_config.num_hidden_layers)
        }

    def bind_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """vLLM's KV cache groups: where a hybrid model's state blocks are."""
        if self.state is not None:
            self.state.bind(kv_cache_config)

    def _attention_blocks(self, state: CachedRequestState) -> list[int]:
        """The request's blocks of the attention layers' KV cache group."""
        return state.block_ids[self.state.attention_group if self.state else 0]

    def _state_slots(self, state: CachedRequestState, computed: int, end: int) -> np.ndarray | None:
        """A hybrid model's state slots for a block-layout call of [computed, end)."""
        if self.state is None or not self.settings.is_block_layout:
            return None
        return self.state.slots(state.block_ids, computed, end)

    # -- request state -------------------------------------------------------------
    def _new_state(self, data) -> CachedRequestState:
        params = data.sampling_params
        if self.settings.on_device_sampling:
            self._refusals[data.req_id] = on_device_refusal(
                params, self.settings.global_topk, self.settings.exact_sampling
            )
        if params is not None and params.prompt_logprobs is not None:
            self.prompt_scores.add(data.req_id, params.prompt_logprobs, len(data.prompt_token_ids))
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
            if self._slots is not None:
                self._slots.release(req_id)
            state = self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            self.host.remove(req_id)
            self._refusals.pop(req_id, None)
            self.prompt_scores.remove(req_id)
            if self.images is not None:
                self.images.remove(req_id)
            if state is not None:
                self._finish(state)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        scheduled = so.num_scheduled_tokens.keys()
        for req_id in batch.req_id_to_index.keys() - (scheduled - resumed):
            batch.remove_request(req_id)
            self.host.remove(req_id)

        to_add: list[CachedRequestState] = []
        for data in so.scheduled_new_reqs:
            state = self._new_state(data)
            self.requests[data.req_id] = state
            to_add.append(state)
            if self.images is not None:
                self.images.add(data.req_id, state.num_prompt_tokens, data.mm_features)

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
                if self._slots is not None:  # prefilled again, into the lowest free slot
                    self._slots.release(req_id)
                state.block_ids = tuple(list(ids) for ids in new_blocks)
            elif new_blocks is not None:
                for ids, extra in zip(state.block_ids, new_blocks, strict=True):
                    ids.extend(extra)
            index = batch.req_id_to_index.get(req_id)
            if index is None:
                # Back after a preemption or a step unscheduled: the scheduler's tokens
                # are the truth (under async scheduling it may have dropped a token
                # this runner sampled for a step in flight when it preempted).
                known = cached.all_token_ids.get(req_id)
                num_output = cached.num_output_tokens[i]
                if known is not None and num_output > 0:
                    state.output_token_ids[:] = known[-num_output:]
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            batch.num_tokens_no_spec[index] = state.num_tokens
            if new_blocks is not None:
                batch.block_table.append_row(new_blocks, index)
        for state in to_add:
            batch.add_request(state)
            if self._host_sampled(state.req_id):
                self.host.add(state)
        batch.condense()
        batch.refresh_metadata()
        self.host.refresh()

    def _host_sampled(self, req_id: str) -> bool:
        return not self.settings.on_device_sampling or self._refusals[req_id] is not None

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
            batch=max(1, round(timeline.decode_rows / timeline.decode_steps))
            if timeline.decode_steps
            else 1,
            ttft_ms=round(1000 * ((timeline.first_token or started) - started), 3),
            duration_ms=round(1000 * (time.perf_counter() - started), 3),
        )
        for observer in self.observers:
            observer.on_request_finished(request)

    # -- one step --------------------------------------------------------------------
    def _seq_id(self, state: CachedRequestState, index: int) -> int:
        """Contiguous layout: the request's sequence slot, the lowest free one when it
        first runs (core.seq_slots: a decode batch's bucket follows its largest seq_id).
        The block layout addresses the cache through block tables; its seq id is the
        row."""
        if self._slots is None:
            return index
        return self._slots.assign(state.req_id)

    def _run(
        self,
        inputs: ForwardInputs,
        rows: np.ndarray,
        step: PendingStep,
        host_start: float,
        last: bool,
    ) -> None:
        """One backend call for batch rows `rows`: their tokens and needed logits into
        `step`. With async scheduling the step's `last` call is only submitted: the
        backend computes it while the engine schedules the next step, and
        `_complete` collects it."""
        forward_start = time.perf_counter()
        if step.sampling is None and inputs.prompt_targets is None:
            logits = self.backend.forward(inputs)
            forward_s = time.perf_counter() - forward_start
            step.backend_s += forward_s
            self._take(step, rows, rows, None, logits)
        else:
            sampling = (
                SamplingInputs.host_rows(rows.size)
                if step.sampling is None
                else step.sampling.take(rows)
            )
            if last and self.async_scheduling:
                self.backend.submit(inputs, sampling)
                submit_s = time.perf_counter() - forward_start
                step.backend_s += submit_s
                step.in_flight = BackendCall(
                    inputs, rows, sampling, forward_start - host_start, submit_s
                )
                return
            out = self.backend.run(inputs, sampling)
            forward_s = time.perf_counter() - forward_start
            step.backend_s += forward_s
            self._take(step, rows, rows[sampling.needs_logits], out.tokens, out.logits)
            self._take_prompt(inputs, rows, out)
        accepted = _accepted(step.tokens[rows], inputs, step.host[rows])
        for observer in self.observers:
            observer.on_backend_call(inputs, forward_s, forward_start - host_start, accepted)

    def _collect(self, step: PendingStep) -> None:
        """The answer of the step's submitted call (waiting for the backend if need be).
        Its forward time is the backend's own where the backend reports it (a runner),
        else the call's own wall time (in this process `submit` computes it)."""
        call, step.in_flight = step.in_flight, None
        if call is None:
            return
        waited = time.perf_counter()
        out = self.backend.collect()
        waited = time.perf_counter() - waited
        step.backend_s += waited
        rows = call.rows
        self._take(step, rows, rows[call.sampling.needs_logits], out.tokens, out.logits)
        self._take_prompt(call.inputs, rows, out)
        forward_s = out.backend_s if out.backend_s is not None else call.submit_s + waited
        accepted = _accepted(step.tokens[rows], call.inputs, step.host[rows])
        for observer in self.observers:
            observer.on_backend_call(call.inputs, forward_s, call.host_s, accepted)

    @staticmethod
    def _take(
        step: PendingStep,
        rows: np.ndarray,
        host: np.ndarray,
        tokens: np.ndarray | None,
        logits: torch.Tensor,
    ) -> None:
        """A call's device tokens (for `rows`) and host rows' logits into the step (the
        logits may be a view the next call overwrites: copied now)."""
        if tokens is not None:
            step.tokens[rows, : tokens.shape[1]] = tokens
        if host.size:
            # numpy's copy: torch's threads cost more than a few rows' copy
            step.logits.numpy()[step.host_pos[host]] = logits.numpy()

    def _take_prompt(self, inputs: ForwardInputs, rows: np.ndarray, out: StepOutput) -> None:
        """A prefill's prompt logprobs into its request's (from the first position the
        call computed)."""
        if inputs.prompt_targets is None:
            return
        if out.prompt_logprobs is None:
            raise RuntimeError(
                f"the {self.backend.name} backend answered a prompt-logprob call without "
                f"prompt logprobs; report this with the engine log"
            )
        req_id = self.input_batch.req_ids[int(rows[0])]
        start = int(inputs.computed_context_lens[0])
        self.prompt_scores.take(req_id, start, out.prompt_logprobs)

    def _prompt_targets(self, state: CachedRequestState, inputs: ForwardInputs) -> ForwardInputs:
        """A prefill of a request that scores its prompt carries the tokens its
        positions score (none where the call scores nothing, e.g. the last prompt token)."""
        if not self.prompt_scores.wants(state.req_id) or inputs.phase != CONTEXT_ENCODING:
            return inputs
        start = int(inputs.computed_context_lens[0])
        count = int(inputs.full_context_lens[0]) - start
        targets = prompt_targets(
            np.asarray(state.prompt_token_ids), start, count, inputs.input_ids.shape[1]
        )
        if not scored_positions(targets):
            return inputs
        return dataclasses.replace(inputs, prompt_targets=targets)

    def _new_step(self, so: SchedulerOutput, samples: np.ndarray) -> PendingStep:
        """Which rows the host samples (and where they sit in the host batch), and the
        device rows' sampling values."""
        batch = self.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids
        host = np.fromiter((self._host_sampled(r) for r in req_ids), dtype=bool, count=n)
        host_pos = np.full(n, -1, dtype=np.int64)
        rows = np.flatnonzero(host)
        host_pos[rows] = self.host.rows_of([req_ids[i] for i in rows])
        if rows.size != self.host.num_rows:  # the two batches are updated together
            raise RuntimeError(
                f"the host-sampled batch holds {self.host.num_rows} requests, the step "
                f"{rows.size}: report this with the engine log"
            )
        logits = torch.empty((rows.size, self.vocab_size), dtype=torch.float32)
        width = decode_width(self.settings)
        tokens = np.full((n, width), NO_TOKEN, dtype=np.int32)
        if not self.settings.on_device_sampling:
            return PendingStep(so, samples, host, host_pos, logits, None, tokens)
        sampling = SamplingInputs.for_rows(
            batch.temperature_cpu[:n],
            batch.top_k_cpu[:n],
            batch.top_p_cpu[:n],
            host,
            self._draws.random((n, width), dtype=np.float32),
            self.settings.global_topk,
        )
        return PendingStep(so, samples, host, host_pos, logits, sampling, tokens)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        # The previous step's tokens first: this step's inputs and the scheduler's view
        # of each request (update_states) build on them.
        self._complete_in_flight()
        started = time.perf_counter()
        if self.kv_transfer is not None:  # loads write the cache: nothing is in flight
            self.kv_transfer.begin(so)
        self.update_states(so)
        if self.images is not None:  # nothing is in flight: the backend is free
            self.images.encode(so.free_encoder_mm_hashes, so.scheduled_encoder_inputs)
        if so.total_num_scheduled_tokens == 0:
            if self.kv_transfer is not None:
                return ModelRunnerOutput.with_kv_conn_output_only(
                    self.kv_transfer.finish(so.finished_req_ids)
                )
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids
        # A row's own tokens; with speculation vLLM also schedules its drafts
        # (scheduled_spec_decode_tokens), which the decode call verifies.
        spec = so.scheduled_spec_decode_tokens
        scheduled = np.array(
            [so.num_scheduled_tokens[r] - len(spec.get(r, ())) for r in req_ids], dtype=np.int64
        )
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        total = batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        slots, failed = self._adapter_slots(num_reqs)
        runs = np.fromiter((r not in failed for r in req_ids), dtype=bool, count=num_reqs)
        samples = (computed + scheduled >= total) & runs
        decoding = (scheduled == 1) & (computed > 0) & runs
        if self.images is not None:  # a last prompt token inside an image is a prefill
            decoding &= ~self.images.in_images(req_ids, computed)
        step = self._new_step(so, samples)
        step.failed = failed
        step.logits[step.host_pos[~runs & step.host]] = 0  # never computed: sampled, dropped
        prefills = np.flatnonzero(~decoding & runs)

        # The decode batch runs first: its pad rows write into the cache lines of the
        # seq_ids it lacks, which must not yet hold a request prefilled in this step (a
        # sliding-window line is a rolling buffer with no position left unread).
        rows = np.flatnonzero(decoding)
        if rows.size:
            host_start = time.perf_counter()
            positions = computed[rows]
            states = [self.requests[req_ids[i]] for i in rows]
            drafts, budget = self.drafts.scheduled(
                [spec.get(req_ids[i], ()) for i in rows], step.host[rows]
            )
            inputs = token_generation_inputs(
                self.settings,
                batch.token_ids_cpu[rows, positions],
                positions,
                np.array(
                    [self._seq_id(s, int(i)) for s, i in zip(states, rows, strict=True)],
                    dtype=np.int64,
                ),
                [self._attention_blocks(s) for s in states]
                if self.settings.is_block_layout
                else None,
                drafts,
                budget,
                logits=step.sampling is None or bool(step.sampling.needs_logits[rows].any()),
                adapter_slots=slots[rows],
                state=_stacked(
                    [
                        self._state_slots(s, int(p), int(p) + 1)
                        for s, p in zip(states, positions, strict=True)
                    ]
                ),
            )
            if self.images is not None:
                inputs = self.images.decode([req_ids[i] for i in rows], inputs)
            self._run(inputs, rows, step, host_start, last=not prefills.size)
            for state in states:  # the decode batch each request saw, for its trace
                timeline = self._timelines.get(state.req_id)
                if timeline is not None:
                    timeline.decode_steps += 1
                    timeline.decode_rows += rows.size

        for n, index in enumerate(prefills, start=1):
            host_start = time.perf_counter()
            state = self.requests[req_ids[index]]
            start, count = int(computed[index]), int(scheduled[index])
            inputs = context_encoding_inputs(
                self.settings,
                batch.token_ids_cpu[index, : start + count],
                start,
                self._seq_id(state, int(index)),
                self._attention_blocks(state),
                adapter_slot=int(slots[index]),
                state=self._state_slots(state, start, start + count),
            )
            inputs = self._prompt_targets(state, inputs)
            if self.prompt_scores.wants(state.req_id) and start + count >= state.num_prompt_tokens:
                step.prompt_done.append(state.req_id)
            if self.images is not None:
                inputs = self.images.context(state.req_id, inputs)
            self._run(inputs, np.array([index]), step, host_start, last=n == prefills.size)
            if state.req_id not in self._timelines:
                self._timelines[state.req_id] = _Timeline(host_start, start, list(inputs.bucket))

        step.active_s += time.perf_counter() - started
        self._pending = step
        return None

    def _adapter_slots(self, num_reqs: int) -> tuple[np.ndarray, dict[str, str]]:
        """Each batch row's adapter slot, the step's adapters written into slots first
        (the previous step's call has completed: execute_model collected it), and the
        requests whose adapter could not be written (request id -> why)."""
        ids = self.input_batch.request_lora_mapping[:num_reqs].astype(np.int64)
        if self.adapters is None or not ids.any():
            return np.zeros(num_reqs, dtype=np.int64), {}
        req_ids = self.input_batch.req_ids
        rows = np.flatnonzero(ids)
        adapters, first = np.unique(ids[rows], return_index=True)  # one row per adapter
        requests = {
            int(adapter): self.requests[req_ids[rows[i]]].lora_request
            for adapter, i in zip(adapters, first, strict=True)
        }
        slots, failed = self.adapters.prepare_step(requests)
        if failed and not can_fail_requests(self.vllm_config):
            raise AdapterError(next(iter(failed.values())))  # no other way to end them
        failures = {req_ids[i]: failed[int(ids[i])] for i in rows if int(ids[i]) in failed}
        return row_slots(ids, slots), failures

    def _host_sample(self, step: PendingStep) -> LogprobsLists | None:
        """vLLM's Sampler over the host rows alone: their tokens into `step.tokens`,
        their logprobs in the step's row order."""
        rows = np.flatnonzero(step.host)
        host_rows = step.host_pos[rows]
        samples = np.zeros(self.host.num_rows, dtype=bool)
        samples[host_rows] = step.samples[rows]
        tokens, logprobs = self.host.sample(
            step.logits, samples, step.scheduler_output, step.grammar_output
        )
        step.tokens[rows] = NO_TOKEN  # a host row takes no drafts: one token
        step.tokens[rows, 0] = tokens[host_rows]
        if logprobs is None:
            return None
        return logprobs_in_step_order(logprobs, host_rows, step.host)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Without async scheduling, the step's tokens. With it, their promise: the
        step completes (the backend's answer collected, the host rows sampled) when vLLM
        asks for the output or when the next step starts, whichever comes first; the
        engine schedules the next step meanwhile."""
        step, self._pending = self._pending, None
        if step is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step.grammar_output = grammar_output
        if not self.async_scheduling:
            return self._complete(step)
        self._in_flight = step
        return AsyncStepOutput(self._complete, step)

    def _complete_in_flight(self) -> None:
        step = self._in_flight
        if step is not None:
            self._complete(step)

    def _complete(self, step: PendingStep) -> ModelRunnerOutput:
        """Collect the step's backend answer, sample its host rows, append every row's
        token to the batch and build vLLM's output; once (vLLM may ask from its output
        thread while the next step starts)."""
        with self._complete_lock:
            if step.output is not None:
                return step.output
            started = time.perf_counter()
            self._collect(step)
            logprobs = self._host_sample(step) if step.host.any() else None
            step.output = self._output(step, logprobs)
            if self.kv_transfer is not None:  # saves read what the step's calls wrote
                step.output.kv_connector_output = self.kv_transfer.finish(
                    step.scheduler_output.finished_req_ids
                )
            if self._in_flight is step:
                self._in_flight = None
            step.active_s += time.perf_counter() - started
            for observer in self.observers:
                observer.on_step(step.active_s - step.backend_s)
            return step.output

    def _output(self, step: PendingStep, logprobs: LogprobsLists | None) -> ModelRunnerOutput:
        batch = self.input_batch  # still this step's: the next step has not started
        tokens: list[list[int]] = []
        for index, req_id in enumerate(batch.req_ids):
            if not step.samples[index]:
                tokens.append([])
                continue
            row = step.tokens[index]
            emitted = row[row != NO_TOKEN].tolist()
            end = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, end : end + len(emitted)] = emitted
            batch.is_token_ids[index, end : end + len(emitted)] = True
            batch.num_tokens_no_spec[index] = end + len(emitted)
            self.requests[req_id].output_token_ids.extend(emitted)
            tokens.append(emitted)
            timeline = self._timelines.get(req_id)
            if timeline is not None and timeline.first_token is None:
                timeline.first_token = time.perf_counter()
        self.drafts.propose(batch, tokens, step.host)
        return RunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs_dict={r: self.prompt_scores.finish(r) for r in step.prompt_done},
            failed_requests=step.failed,
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts for the requests' next step (vLLM calls this after each step with
        speculative decoding), once."""
        return self.drafts.take()


def _stacked(rows: list[np.ndarray | None]) -> np.ndarray | None:
    """Each row's state slots as one [rows, 2, state layers] array (None without)."""
    present = [row for row in rows if row is not None]  # a model's rows all have them or none
    return np.stack(present) if present else None


def _accepted(tokens: np.ndarray, inputs: ForwardInputs, host: np.ndarray) -> int:
    """Drafts a call's device rows accepted: tokens they emit beyond the first."""
    if not inputs.draft_budget.any():
        return 0
    emitted = (tokens[~host] != NO_TOKEN).sum(axis=1)
    return int(np.maximum(emitted - 1, 0).sum())
