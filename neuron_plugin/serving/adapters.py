"""LoRA adapters on the worker: read and checked once (`adapter_files`), held on the
host, written into the backend's compiled slots as steps need them.

Holding (`AdapterStore`): vLLM's worker API (`add_lora`, `remove_lora`, `pin_lora`,
`list_loras`) acts on a host cache of up to --max-cpu-loras adapters, least recently
used evicted first, never a pinned one (vLLM's rule). Every adapter read is kept, once
every check has passed, as a private verified copy (`adapter_copies.PrivateCopies`,
within a budget), so evicting one costs nothing but a later rebuild from that copy: its
own folder is not read again (unless the copy itself was evicted to keep the budget). A
request may also name an adapter the worker has never seen (offline
`LLM.generate(lora_request=...)`): it is read and checked when its first step comes, as
vLLM's GPU runner does. `/v1/unload_lora_adapter` never reaches the worker (vLLM's API
server only forgets the name), so adapters leave the host by eviction, and their private
copies by the budget or when the worker stops.

Reloading in place (`load_inplace`, the reference backend): the adapter's folder is read
and checked again, and its slot is rewritten before the next step that uses it, so every
request using the adapter, those in flight included, runs the new weights from then on
(vLLM's own semantics; vLLM also keeps prefix-cache blocks computed with the old weights:
load changed weights under a new name to keep requests in flight on theirs).

Slots (`prepare_step`): before a step's backend calls the adapters its rows use get
slots (`core.adapters.AdapterSlots`); those not already there are written into the
backend. The model runner calls it only after the previous step's backend call has
completed, so a slot is never rewritten under a call in flight, and a running request's
adapter is never evicted from a slot in a step that uses it. An adapter that cannot be
written (an offline first read that fails its checks, a backend that refuses the write,
a private copy gone) fails only the step's requests that name it: its slot is left empty
and consistent, and `prepare_step` returns the reason, which the model runner turns into
those requests' error (`serving.request_errors`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.exceptions import LoRAAdapterNotFoundError

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import LoadedBackend
from neuron_plugin.core.adapters import AdapterError, AdapterSlots, AdapterWeights
from neuron_plugin.core.lora import LoraGeometry
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.kv_transfer.payload import adapter_identity
from neuron_plugin.serving.adapter_copies import DEFAULT_ROOM, PrivateCopies, max_bytes_setting
from neuron_plugin.serving.adapter_files import CONFIG_LIMIT, AdapterChecks, AdapterFiles

logger = plugin_logger(__name__)


@dataclass(frozen=True)
class _Verified:
    """Where an adapter's verified files are kept, and what they were."""

    name: str
    given: str  # the path the adapter was loaded from
    digest: str


class AdapterStore:
    """The worker's adapters (see the module docstring)."""

    def __init__(
        self,
        settings: NeuronSettings,
        geometry: LoraGeometry,
        backend: LoadedBackend,
        lora_config: Any,
        max_position_embeddings: int | None,
        base_modules: frozenset[str],
        copies_parent: str | Path | None = None,
    ):
        self.settings = settings
        self.backend = backend
        self.checks = AdapterChecks(
            settings, geometry, lora_config, max_position_embeddings, base_modules
        )
        self.capacity = settings.max_cpu_loras
        self._held: OrderedDict[int, AdapterWeights] = OrderedDict()  # LRU first
        self._pinned: set[int] = set()
        self._active: set[int] = set()  # the step's adapters, while prepare_step runs
        self._verified: dict[int, _Verified] = {}
        in_use = settings.max_cpu_loras + settings.max_loras
        default = DEFAULT_ROOM * in_use * (self.checks.slot_bytes_limit + CONFIG_LIMIT)
        self.copies = PrivateCopies(max_bytes_setting(default), copies_parent)
        self.slots = AdapterSlots(settings.max_loras)

    def read(self, request: Any) -> AdapterWeights:
        """Read and check the adapter a LoRARequest names, then keep its verified copy
        (nothing is written for an adapter that fails a check)."""
        name, given = request.lora_name, str(request.lora_path)
        files = self.checks.read(name, given)
        adapter = self._verify(files, name, request.lora_int_id, given, files.digest)
        evicted = self.copies.keep(
            files, self._digests_in_use(), f"LoRA adapter {name!r} ({given})"
        )
        for adapter_id, kept in list(self._verified.items()):
            if kept.digest in evicted:  # read from its folder again when next needed
                del self._verified[adapter_id]
        self._verified[request.lora_int_id] = _Verified(name, given, files.digest)
        return adapter

    def _digests_in_use(self) -> set[str]:
        """The copies of adapters held, in a slot, pinned or used by the step."""
        ids = set(self._held) | self.slots.adapter_ids() | self._pinned | self._active
        return {self._verified[i].digest for i in ids if i in self._verified}

    def identity(self, request: Any) -> str:
        """The adapter a LoRARequest names as a KV payload names it (name and the digest
        of its verified files; `kv_transfer.payload.adapter_identity`), read and checked
        now if this worker has not read it yet."""
        kept = self._verified.get(request.lora_int_id)
        if kept is None:
            self.read(request)
            kept = self._verified[request.lora_int_id]
        return adapter_identity(request.lora_name, kept.digest)

    def _verify(
        self, files: AdapterFiles, name: str, adapter_id: int, given: str, digest: str
    ) -> AdapterWeights:
        # NxDI reads the path it is given at every re-add: the verified copy. A backend
        # that serves only its start-up adapters is given the folder it started with.
        loading = self.backend.adapter_loading
        copy = self.copies.folder(digest)
        path = str(copy) if loading.at_run_time else os.path.realpath(given)
        return self.checks.verify(files, name, adapter_id, given, path)

    def _rebuild(self, adapter_id: int) -> AdapterWeights | None:
        """An evicted adapter from its verified copy (None: never read here)."""
        kept = self._verified.get(adapter_id)
        if kept is None:
            return None
        files = self.copies.read(kept.digest, f"LoRA adapter {kept.name!r} ({kept.given})")
        return self._verify(files, kept.name, adapter_id, kept.given, kept.digest)

    def add(self, request: Any) -> bool:
        """vLLM's add_lora: read (or, with load_inplace, reread) and hold the adapter."""
        adapter_id = request.lora_int_id
        if adapter_id in self._held and not request.load_inplace:
            self._held.move_to_end(adapter_id)
            return True
        refusal = self.backend.adapter_loading.refusal(
            request.lora_name, str(Path(request.lora_path).expanduser())
        )
        if refusal is not None:
            raise AdapterError(refusal)
        known = adapter_id in self._verified or self.slots.slot_of(adapter_id) is not None
        if request.load_inplace and self.settings.backend == "nxd" and known:
            raise AdapterError(
                f"LoRA adapter {request.lora_name!r}: reloading it in place is not served on "
                f"the nxd backend (NxDI keeps an adapter's device copy by name); load the "
                f"new weights under a new name."
            )
        adapter = self.read(request)
        if request.load_inplace:  # its slot, if any, holds the old weights (held or not)
            self.slots.forget(adapter_id)
        self._hold(adapter)
        logger.info(
            "LoRA adapter %r (id %d, rank %d, %s) loaded from %s",
            adapter.name,
            adapter_id,
            adapter.rank,
            ", ".join(adapter.a),
            request.lora_path,
        )
        return True

    def _hold(self, adapter: AdapterWeights) -> None:
        self._held[adapter.adapter_id] = adapter
        self._held.move_to_end(adapter.adapter_id)
        while len(self._held) > self.capacity:
            keep = self._pinned | self._active | {adapter.adapter_id}
            victim = next((a for a in self._held if a not in keep), None)
            if victim is None:
                del self._held[adapter.adapter_id]
                raise AdapterError(
                    f"LoRA adapter {adapter.name!r}: the host holds --max-cpu-loras "
                    f"{self.capacity} adapters and all of them are pinned ("
                    f"{len(self._pinned)}) or used by this step; remove a pinned one or "
                    f"restart with a larger --max-cpu-loras."
                )
            evicted = self._held.pop(victim)
            logger.info("LoRA adapter %r (id %d) evicted from the host", evicted.name, victim)

    def remove(self, adapter_id: int) -> bool:
        """vLLM's remove_lora: forget the adapter. A running request that uses it keeps
        its slot (and rebuilds it from its verified copy if it needs it again later)."""
        self._pinned.discard(adapter_id)
        return self._held.pop(adapter_id, None) is not None

    def pin(self, adapter_id: int) -> bool:
        """vLLM's pin_lora: never evict it from the host."""
        if adapter_id not in self._held:
            raise AdapterError(
                f"pin_lora({adapter_id}): no adapter with that id is loaded; load it first "
                f"(add_lora / /v1/load_lora_adapter)."
            )
        self._pinned.add(adapter_id)
        return True

    def ids(self) -> set[int]:
        return set(self._held)

    def prepare_step(self, requests: Mapping[int, Any]) -> tuple[dict[int, int], dict[int, str]]:
        """Slots for the adapters of a step (lora_int_id -> its LoRARequest), written into
        the backend where they are not yet: (adapter id -> slot, adapter id -> why it
        could not be written, for the adapters that fail their requests)."""
        slots, writes = self.slots.assign(requests)
        self._active = set(requests)
        failed: dict[int, str] = {}
        try:
            for slot, adapter_id in writes:
                try:
                    self._write(slot, adapter_id, requests[adapter_id])
                except (NeuronConfigError, LoRAAdapterNotFoundError) as exc:
                    failed[adapter_id] = str(exc)  # AdapterError, or a backend's refusal
        finally:
            self._active = set()
        for adapter_id, reason in failed.items():
            self.slots.forget(adapter_id)  # its slot holds no (whole) adapter
            slots.pop(adapter_id)
            logger.error("LoRA adapter %d failed its requests in this step: %s", adapter_id, reason)
        return slots, failed

    def _write(self, slot: int, adapter_id: int, request: Any) -> None:
        adapter = self._held.get(adapter_id)
        if adapter is None:  # evicted or removed (its verified copy), or never added
            adapter = self._rebuild(adapter_id) or self.read(request)
            self._hold(adapter)
        else:
            self._held.move_to_end(adapter_id)
        self.backend.set_adapter(slot, adapter)
        logger.debug("LoRA adapter %r written into slot %d", adapter.name, slot)

    def close(self) -> None:
        """Remove the verified copies (the worker stops)."""
        self.copies.close()
