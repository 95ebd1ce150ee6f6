"""`NeuronKVConnector`: vLLM's KV-connector v1 contract for Neuron, loaded with

    --kv-transfer-config '{"kv_connector": "NeuronKVConnector",
        "kv_connector_module_path": "neuron_plugin.kv_transfer.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

on a prefill and a decode server behind `vllm-router --vllm-pd-disaggregation`.

Prefill server: a request with `do_remote_decode` (the router's prefill request, one
output token) is computed as usual; in the step its prompt completes, the worker reads
the request's KV blocks out of the backend (`read_kv_blocks`, every layer in one call)
and writes them as a payload file (`payload`) before the step's output leaves the
worker, so the file is whole before the HTTP response. `request_finished` answers
`kv_transfer_params` naming it (`params`); the blocks are freed at once (no delayed free,
no lease: the payload holds its own copy).

Decode server: a request with `do_remote_prefill` is an asynchronous external hit of its
whole prompt (`get_num_new_matched_tokens` -> (prompt - local hit, True)); vLLM allocates
its blocks and parks it in WAITING_FOR_REMOTE_KVS. At the next step the worker reads the
payload, checks it (model, computation, dtype, block size, geometry, prompt, and that
it was computed for the request's own LoRA adapter and cache salt), writes the blocks past
the local prefix-cache hit into the backend (`write_kv_blocks`), deletes the file and
reports the request in `finished_recving`; vLLM then schedules it with its last prompt
token to compute, and it decodes. A payload that is missing, corrupt, unsigned or
forged (`auth`), holding NaN/Inf, or not this server's goes to `failed_recving` with its
reason logged, and vLLM applies `kv_load_failure_policy`: `recompute` (the decode server
computes the prompt itself) or `fail` (the request ends with an error). Nothing a load
meets ends the engine: every error of a load fails that request only.

Payload lifetime: a request's payload is deleted once loaded, and whenever the request
ends without loading it (aborted, params refused or unusable: the key a request names is
kept for this even when the rest is wrong); a sweep at start-up, every ttl_s / 4 on a
timer thread and at shutdown deletes those older than `ttl_s` (what vLLM's API server
refused before the engine saw it); a prefill server writes no payload that would take
the folder past `max_bytes`.

vLLM calls the worker side from the model runner (`serving.kv_steps`) on every engine
step, steps without scheduled tokens included (a waiting load is done in such a step).
The layer hooks (`wait_for_layer_load`, `save_kv_layer`) are called by vLLM attention
layers, which this platform has none of: the compiled graphs read and write the whole
cache, so transfers happen between backend calls.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from neuron_plugin import plugin_logger
from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.backends.runner.client import RunnerError
from neuron_plugin.core.kv_transfer import TransferOptions, transfer_options
from neuron_plugin.core.neuron_settings import NeuronSettings
from neuron_plugin.kv_transfer import auth, payload
from neuron_plugin.kv_transfer.params import (
    decode_params,
    named_key,
    new_key,
    remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = plugin_logger(__name__)


class KVBlockIO(Protocol):
    """The part of the backend contract the worker side uses (`backends.base`)."""

    def kv_geometry(self) -> KVGeometry: ...

    def read_kv_blocks(self, block_ids: np.ndarray) -> torch.Tensor: ...

    def write_kv_blocks(self, block_ids: np.ndarray, kv: torch.Tensor) -> None: ...


class AdapterIdentities(Protocol):
    """What the worker side asks the worker's adapters (`serving.adapters.AdapterStore`):
    a LoRARequest's adapter as a payload names it (`payload.adapter_identity`)."""

    def identity(self, request: Any) -> str: ...


@dataclass(frozen=True)
class SaveJob:
    """Write this prefill request's blocks as payload `key`; `lora` is the request's
    LoRARequest (None: the base model), `cache_salt` its salt."""

    req_id: str
    key: str
    block_ids: list[int]
    token_ids: list[int]
    lora: Any = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class LoadJob:
    """Load payload `key` into this decode request's blocks from `first_block` on (the
    ones before hold a local prefix-cache hit); `error` when its params are unusable
    (`key` is then the payload to delete, if they name one)."""

    req_id: str
    key: str | None
    error: str | None
    block_ids: list[int]
    first_block: int
    token_ids: list[int]
    lora: Any = None  # the request's LoRARequest (None: the base model)
    cache_salt: str | None = None


@dataclass
class NeuronKVMetadata(KVConnectorMetadata):
    """One step's jobs, from the scheduler side to the worker side."""

    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


class SchedulerSide:
    """Which requests save or load, and their blocks (module docstring)."""

    def __init__(self, vllm_config: VllmConfig):
        config = vllm_config.kv_transfer_config
        assert config is not None  # the connector exists only with one
        self.block_size = vllm_config.cache_config.block_size
        # the payload folder, to delete payloads no load will take (`_discard`)
        self.folder = transfer_options(config.kv_connector_extra_config).path
        self.saves = config.is_kv_producer
        self.loads = config.is_kv_consumer
        self._keys: dict[str, str] = {}  # prefill request -> its payload's key
        self._prompts: dict[str, list[int]] = {}
        self._scopes: dict[str, tuple[Any, str | None]] = {}  # prefill -> (LoRA, salt)
        self._blocks: dict[str, list[int]] = {}  # prefill request -> its blocks so far
        self._saved: set[str] = set()
        self._local_hit: dict[str, int] = {}  # decode request -> local tokens at match
        self._tried: set[str] = set()  # decode requests whose load was planned once
        self._new_loads: list[LoadJob] = []

    def on_new_request(self, request: Request) -> None:
        if self.saves and wants_remote_decode(request.kv_transfer_params):
            self._keys[request.request_id] = new_key()
            self._prompts[request.request_id] = list(request.prompt_token_ids or ())
            self._scopes[request.request_id] = (request.lora_request, request.cache_salt)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A decode request's whole prompt past the local hit, loaded asynchronously;
        once only (after a failed load with `recompute` it is computed here)."""
        rid = request.request_id
        if not self.loads or rid in self._tried:
            return 0, False
        if not wants_remote_prefill(request.kv_transfer_params):
            return 0, False
        external = request.num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        self._local_hit[rid] = num_computed_tokens
        return external, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        rid = request.request_id
        if rid not in self._local_hit:
            return
        self._tried.add(rid)
        local = self._local_hit.pop(rid)
        key, error = self._key(request)
        if num_external == 0:  # vLLM dropped the external hit: it computes the prompt
            self._discard(key)
            return
        prompt = list(request.prompt_token_ids or ())
        self._new_loads.append(
            LoadJob(
                rid,
                key,
                error,
                list(blocks.get_block_ids()[0]),
                local // self.block_size,
                prompt,
                request.lora_request,
                request.cache_salt,
            )
        )

    def build_meta(self, so: SchedulerOutput) -> NeuronKVMetadata:
        saves: list[SaveJob] = []
        for new in so.scheduled_new_reqs:
            if new.req_id in self._keys:
                self._blocks[new.req_id] = list(new.block_ids[0])
                self._maybe_save(new.req_id, new.num_computed_tokens, so, saves)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._blocks:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if rid in cached.resumed_req_ids:  # after a preemption: all its blocks
                    self._blocks[rid] = list(new_blocks[0])
                else:
                    self._blocks[rid].extend(new_blocks[0])
            self._maybe_save(rid, cached.num_computed_tokens[i], so, saves)
        loads, self._new_loads = self._new_loads, []
        return NeuronKVMetadata(saves=saves, loads=loads)

    def _maybe_save(
        self, rid: str, computed: int, so: SchedulerOutput, saves: list[SaveJob]
    ) -> None:
        """A save job in the step that completes the request's prompt."""
        prompt = self._prompts[rid]
        if rid in self._saved or computed + so.num_scheduled_tokens.get(rid, 0) < len(prompt):
            return
        blocks = math.ceil(len(prompt) / self.block_size)
        lora, salt = self._scopes[rid]
        saves.append(SaveJob(rid, self._keys[rid], self._blocks[rid][:blocks], prompt, lora, salt))
        self._saved.add(rid)

    def finished(self, request: Request) -> dict[str, Any] | None:
        """The prefill request's params for the decode server (None for any other).
        A payload nobody will load is deleted here rather than left to `ttl_s`: an
        aborted prefill's, and the one a request names that ended before its load (or
        never had one planned: params refused or not asking for it)."""
        rid = request.request_id
        if rid not in self._tried:
            self._discard(named_key(request.kv_transfer_params))
        self._tried.discard(rid)
        self._local_hit.pop(rid, None)
        self._blocks.pop(rid, None)
        prompt = self._prompts.pop(rid, None)
        self._scopes.pop(rid, None)
        key = self._keys.pop(rid, None)
        saved = rid in self._saved
        self._saved.discard(rid)
        if key is None or prompt is None or not saved:
            return None  # not a prefill request, or it ended before its prompt was done
        if request.status == RequestStatus.FINISHED_ABORTED:  # the client went away
            self._discard(key)
            return None
        return decode_params(key, len(prompt))

    @staticmethod
    def _key(request: Request) -> tuple[str | None, str | None]:
        """(the payload key a decode request names, None when its params are usable);
        with unusable params the key is still the one they name, for deletion."""
        params = request.kv_transfer_params or {}
        try:
            return remote_prefill(params, len(request.prompt_token_ids or ())).key, None
        except ValueError as exc:
            return named_key(params), str(exc)

    def _discard(self, key: str | None) -> None:
        """Delete a payload no load will take (a failure is logged: the sweep gets it)."""
        if key is not None:
            payload.remove_payload(self.folder, key)


class WorkerSide:
    """Moves blocks between the backend and payload files (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, options: TransferOptions):
        config = vllm_config.kv_transfer_config
        assert config is not None
        self.options = options
        self.recompute = config.kv_load_failure_policy == "recompute"
        self.folder = payload.prepare_folder(options.path)
        self.max_bytes = options.max_bytes or payload.default_max_bytes(self.folder)
        self.secret = auth.load_key()
        self.model_dir = vllm_config.model_config.model
        self.model: str | None = None
        self.max_blocks = 0
        self.io: KVBlockIO | None = None
        self.geometry: KVGeometry | None = None
        self.adapters: AdapterIdentities | None = None
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        # Totals since start (bytes of payload files), for telemetry and benchmarks.
        self.saved_bytes = 0
        self.loaded_bytes = 0
        self._stop = threading.Event()
        self._sweeper = threading.Thread(
            target=self._sweep_every, name="neuron-kv-sweep", daemon=True
        )
        self._sweeper.start()

    def bind(
        self, io: KVBlockIO, settings: NeuronSettings, adapters: AdapterIdentities | None = None
    ) -> None:
        """The backend that owns the KV cache, the settings it was resolved with (the
        model's identity covers their weight quantization) and, with LoRA, the worker's
        adapters (a payload names the adapter that computed it)."""
        self.io = io
        self.adapters = adapters
        self.geometry = io.kv_geometry()
        self.model = payload.model_identity(self.model_dir, settings.quantization)
        self.max_blocks = settings.max_blocks_per_seq
        logger.info(
            "KV transfer: payloads in %s (%s per block: %d layers x K/V x %d tokens x %d "
            "KV heads x %d, %s; at most %s bytes in all); loads failing: %s",
            self.folder,
            f"{self.geometry.block_bytes:,} bytes",
            self.geometry.layers,
            self.geometry.block_size,
            self.geometry.kv_heads,
            self.geometry.head_dim,
            self.geometry.dtype,
            f"{self.max_bytes:,}",
            "recompute" if self.recompute else "fail the request",
        )

    def _bound(self) -> tuple[KVBlockIO, KVGeometry, str]:
        if self.io is None or self.geometry is None or self.model is None:
            raise RuntimeError("NeuronKVConnector used before the worker bound its backend")
        return self.io, self.geometry, self.model

    def load(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            self._recving.add(job.req_id)
            try:
                self._load(job)
            except Exception as exc:  # a load fails its request, never the engine
                self._failed.add(job.req_id)
                expected = isinstance(exc, (ValueError, OSError, RunnerError))
                (logger.error if expected else logger.exception)(
                    "KV transfer for request %s failed: %s. %s",
                    job.req_id,
                    exc if expected else f"{type(exc).__name__}: {exc}",
                    "The decode server computes the prompt itself (kv_load_failure_policy "
                    "recompute)."
                    if self.recompute
                    else "The request fails (kv_load_failure_policy fail; recompute "
                    "serves it from the prompt instead).",
                )
            finally:
                if job.key is not None:
                    payload.remove_payload(self.folder, job.key)

    def _load(self, job: LoadJob) -> None:
        if job.error is not None or job.key is None:
            raise ValueError(job.error or "no payload key")
        io, geometry, model = self._bound()
        kv = payload.read_payload(
            self.folder,
            job.key,
            model,
            geometry,
            job.token_ids,
            self.max_blocks,
            self.secret,
            scope=self._scope(job.lora, job.cache_salt),
        )
        blocks = kv.shape[2]
        if len(job.block_ids) < blocks:
            raise ValueError(
                f"the request holds {len(job.block_ids)} blocks for a payload of {blocks}"
            )
        if job.first_block < blocks:
            ids = np.array(job.block_ids[job.first_block : blocks], dtype=np.int64)
            io.write_kv_blocks(ids, kv[:, :, job.first_block : blocks].contiguous())
        self.loaded_bytes += int(kv.numel() * kv.element_size())
        logger.debug("KV transfer: loaded request %s (%d blocks)", job.req_id, blocks)

    def save(self, jobs: list[SaveJob]) -> None:
        for job in jobs:
            try:
                io, geometry, model = self._bound()
                kv = io.read_kv_blocks(np.array(job.block_ids, dtype=np.int64))
                size = payload.write_payload(
                    self.folder,
                    job.key,
                    kv,
                    job.token_ids,
                    model,
                    geometry,
                    self.secret,
                    self.max_bytes,
                    scope=self._scope(job.lora, job.cache_salt),
                )
                self.saved_bytes += size
                logger.debug("KV transfer: saved request %s (%d bytes)", job.req_id, size)
            except Exception as exc:  # a save fails its payload, never the engine
                # The decode server finds no payload and applies its failure policy.
                expected = isinstance(exc, (ValueError, OSError, RunnerError))
                (logger.error if expected else logger.exception)(
                    "KV transfer: saving request %s failed: %s", job.req_id, exc
                )

    def _scope(self, lora: Any, cache_salt: str | None) -> payload.RequestScope:
        """A request's adapter and salt as its payload names them; an adapter this
        worker has not read yet is read and checked now (as its first step would)."""
        adapter = payload.BASE
        if lora is not None:
            if self.adapters is None:
                raise ValueError(
                    f"request names LoRA adapter {lora.lora_name!r} on a server without "
                    f"--enable-lora"
                )
            adapter = self.adapters.identity(lora)
        return payload.RequestScope(adapter, payload.salt_digest(cache_salt))

    def sweep(self) -> None:
        """Delete payloads older than ttl_s (a failure is logged: serving goes on)."""
        try:
            removed = payload.sweep(self.folder, self.options.ttl_s)
        except OSError as exc:  # the folder removed or unreadable
            logger.warning("KV transfer: sweeping %s failed: %s", self.folder, exc)
            return
        if removed:
            logger.info(
                "KV transfer: removed %d payloads no decode server took within ttl_s=%g s",
                removed,
                self.options.ttl_s,
            )

    def _sweep_every(self) -> None:
        """At start, then every ttl_s / 4 (at least each second) until `close`."""
        interval = max(self.options.ttl_s / 4, 1.0)
        while True:
            self.sweep()
            if self._stop.wait(interval):
                return

    def close(self) -> None:
        """Stop the sweeper, sweeping once more."""
        self._stop.set()
        self._sweeper.join(timeout=5)
        self.sweep()

    def results(self) -> KVConnectorTransferResults:
        recving, self._recving = self._recving, set()
        failed, self._failed = self._failed, set()
        return KVConnectorTransferResults(finished_recving=recving, failed_recving=failed)


class NeuronKVConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        assert config is not None  # the base class refuses to start without one
        options = transfer_options(config.kv_connector_extra_config)
        self._scheduler = SchedulerSide(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        self._worker = WorkerSide(vllm_config, options) if role == KVConnectorRole.WORKER else None

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker's NeuronKVConnector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler's NeuronKVConnector")
        return self._worker

    # -- worker side ---------------------------------------------------------------------
    def bind_backend(
        self, io: KVBlockIO, settings: NeuronSettings, adapters: AdapterIdentities | None = None
    ) -> None:
        """The plugin's worker hands over its backend (the KV cache's owner), the
        settings it resolved and its LoRA adapters (None without LoRA)."""
        self._worker_side().bind(io, settings, adapters)

    def transferred_bytes(self) -> dict[str, dict[str, float]]:
        """KV bytes moved since start, as the telemetry's `kv_transfer_bytes` total."""
        worker = self._worker_side()
        return {"kv_transfer_bytes": {"saved": worker.saved_bytes, "loaded": worker.loaded_bytes}}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NeuronKVMetadata)
        self._worker_side().load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by vLLM attention layers, which run nowhere here: every load is done in
        `start_load_kv`, before the step's backend calls."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Called by vLLM attention layers, which run nowhere here: `wait_for_save` reads
        the blocks out of the backend once the step's calls are complete."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NeuronKVMetadata)
        self._worker_side().save(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker_side().results()

    # -- scheduler side ------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler_side().finished(request)
