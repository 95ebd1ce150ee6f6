"""LoRA adapters on the worker: read with vLLM's own PEFT code, held on the host, written
into the backend's compiled slots as steps need them.

Reading (`read_adapter`) reuses vLLM's checks, which run on the CPU without a vLLM model:
`PEFTHelper.from_local_dir` + `validate_legal` (rank above --max-lora-rank, DoRA, biases,
unsupported PEFT variants) and `LoRAModel.from_local_checkpoint` (modules outside the
compiled target modules), then `core.adapters.build_adapter` (shapes of another base
model, layers it does not have) puts the weights in the slot layout. Only
`adapter_model.safetensors` is read: a folder with pickled weights alone (`.bin`, `.pt`)
is refused, since loading a pickle can run code. Every refusal names the adapter.

Holding (`AdapterStore`): vLLM's worker API (`add_lora`, `remove_lora`, `pin_lora`,
`list_loras`) acts on a host cache of up to --max-cpu-loras adapters, least recently used
evicted first, never a pinned one (vLLM's rule). Evicting one a running request uses
costs nothing but a later reread: its weights stay in their slot, and the request keeps
its LoRARequest (path included). A request may also name an
adapter the worker has never seen (offline `LLM.generate(lora_request=...)`): it is read
when its first step comes, as vLLM's GPU runner does. `/v1/unload_lora_adapter` never
reaches the worker (vLLM's API server only forgets the name), so adapters leave by
eviction.

Slots (`prepare_step`): before a step's backend calls the adapters its rows use get
slots (`core.adapters.AdapterSlots`); those not already there are written into the
backend. The model runner calls it only after the previous step's backend call has
completed, so a slot is never rewritten under a call in flight, and a running request's
adapter is never evicted from a slot in a step that uses it. Loading and unloading
therefore never disturb requests in flight: a removed adapter a running request still
uses stays in its slot, and is read again from its path if the request needs it later.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import LoadedBackend
from neuron_plugin.core.adapters import (
    AdapterError,
    AdapterSlots,
    AdapterWeights,
    LayerWeights,
    build_adapter,
)
from neuron_plugin.core.checkpoint import pickle_files
from neuron_plugin.core.lora import MODULE_PARENTS, LoraGeometry
from neuron_plugin.core.settings import NeuronSettings

logger = plugin_logger(__name__)

SAFETENSORS = "adapter_model.safetensors"
# room for a safetensors header (tensor names, shapes, offsets) beside the weights
HEADER_ALLOWANCE = 1 << 20
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


def read_adapter(
    request: Any,
    settings: NeuronSettings,
    geometry: LoraGeometry,
    lora_config: Any,
    max_position_embeddings: int | None,
) -> AdapterWeights:
    """The adapter a vLLM LoRARequest names, checked and in the slot layout."""
    import torch
    from safetensors import SafetensorError
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    name, given = request.lora_name, request.lora_path
    folder = Path(given).expanduser()
    if not (folder / "adapter_config.json").is_file():
        # vLLM's own not-found error: its API server answers it with HTTP 404.
        raise LoRAAdapterNotFoundError(name, given)
    pickles = pickle_files(folder)
    if not (folder / SAFETENSORS).is_file():
        held = f"holds {', '.join(pickles)}" if pickles else "holds no weights file"
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}): the folder {held}, and only "
            f"{SAFETENSORS} is read (a pickled .bin/.pt can run code when loaded); "
            f"convert it with safetensors.torch.save_file, or PEFT's save_pretrained "
            f"(safe_serialization=True)."
        )
    if pickles and settings.backend == "nxd":
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}): the folder also holds {', '.join(pickles)}, "
            f"which NxDI's adapter loader would unpickle beside {SAFETENSORS}; remove "
            f"the pickled files from the folder."
        )
    size = (folder / SAFETENSORS).stat().st_size
    limit = geometry.slot_bytes(settings.max_lora_rank) + HEADER_ALLOWANCE
    if size > limit:  # checked before anything reads the tensors into memory
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}): {SAFETENSORS} is {size:,} bytes, more than "
            f"a float32 adapter of rank --max-lora-rank {settings.max_lora_rank} over every "
            f"compiled target module can hold ({limit:,} bytes with its header); serve an "
            f"adapter of rank <= {settings.max_lora_rank} on "
            f"{', '.join(settings.lora_target_modules)} only."
        )
    try:
        helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings)
        helper.validate_legal(lora_config)
    except (ValueError, TypeError, KeyError) as exc:
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}) is refused by vLLM's adapter checks: {exc} "
            f"(limits: --max-lora-rank {settings.max_lora_rank}; DoRA, adapter biases and "
            f"PEFT variants vLLM does not serve are refused); fix the adapter or restart "
            f"with a larger --max-lora-rank."
        ) from exc
    if helper.modules_to_save:
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}) trains whole modules "
            f"(modules_to_save={helper.modules_to_save}), which the Neuron graphs do not "
            f"carry; serve it merged into the base model instead."
        )
    if settings.backend == "nxd" and (helper.rank_pattern or helper.alpha_pattern):
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}) sets rank_pattern/alpha_pattern, which NxDI's "
            f"loader ignores (it scales every module by lora_alpha / r); retrain it with "
            f"one rank and alpha, or use the reference backend."
        )
    try:
        model = LoRAModel.from_local_checkpoint(
            str(folder),
            set(settings.lora_target_modules),
            peft_helper=helper,
            lora_model_id=request.lora_int_id,
            device="cpu",
            dtype=torch.float32,
        )
    except SafetensorError as exc:
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}): {SAFETENSORS} is not a readable safetensors "
            f"file ({exc}); save the adapter again."
        ) from exc
    except ValueError as exc:
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}) does not fit the compiled LoRA slots: {exc}; "
            f"restart with --lora-target-modules covering its modules (compiled: "
            f"{', '.join(settings.lora_target_modules)})."
        ) from exc
    layers = []
    for module_name, weights in model.loras.items():
        match = _MODULE.match(module_name)
        if match is None or MODULE_PARENTS.get(match[3]) != match[2]:
            raise AdapterError(
                f"LoRA adapter {name!r} ({given}) trains {module_name}, not a projection of "
                f"a decoder layer ({', '.join(MODULE_PARENTS)}); the Neuron graphs carry "
                f"LoRA slots for those only."
            )
        if weights.lora_a is None or weights.lora_b is None:
            half = "lora_B" if weights.lora_a is not None else "lora_A"
            raise AdapterError(
                f"LoRA adapter {name!r} ({given}) has no {half} weight for {module_name} "
                f"(a LoRA module needs both lora_A and lora_B); save the adapter again."
            )
        layers.append(
            LayerWeights(
                layer=int(match[1]),
                module=match[3],
                lora_a=weights.lora_a.numpy().astype(np.float32),
                lora_b=weights.lora_b.numpy().astype(np.float32),
                scaling=float(weights.scaling),
            )
        )
    return build_adapter(
        name, request.lora_int_id, str(folder.resolve()), layers, geometry, settings.max_lora_rank
    )


class AdapterStore:
    """The worker's adapters (see the module docstring)."""

    def __init__(
        self,
        settings: NeuronSettings,
        geometry: LoraGeometry,
        backend: LoadedBackend,
        lora_config: Any,
        max_position_embeddings: int | None,
    ):
        self.settings = settings
        self.geometry = geometry
        self.backend = backend
        self.lora_config = lora_config
        self.max_position_embeddings = max_position_embeddings
        self.capacity = settings.max_cpu_loras
        self._held: OrderedDict[int, AdapterWeights] = OrderedDict()  # LRU first
        self._pinned: set[int] = set()
        self._active: set[int] = set()  # the step's adapters, while prepare_step runs
        self.slots = AdapterSlots(settings.max_loras)

    def read(self, request: Any) -> AdapterWeights:
        return read_adapter(
            request, self.settings, self.geometry, self.lora_config, self.max_position_embeddings
        )

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
        known = adapter_id in self._held or self.slots.slot_of(adapter_id) is not None
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
            adapter.path,
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
        its slot (and rereads it from its path if it needs it again later)."""
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

    def prepare_step(self, requests: Mapping[int, Any]) -> dict[int, int]:
        """Slots for the adapters of a step (lora_int_id -> its LoRARequest), written into
        the backend where they are not yet; adapter id -> slot."""
        slots, writes = self.slots.assign(requests)
        self._active = set(requests)
        try:
            self._write(requests, writes)
        finally:
            self._active = set()
        return slots

    def _write(self, requests: Mapping[int, Any], writes: list[tuple[int, int]]) -> None:
        for done, (slot, adapter_id) in enumerate(writes):
            try:
                adapter = self._held.get(adapter_id)
                if adapter is None:  # never added, evicted, or removed while in use
                    adapter = self.read(requests[adapter_id])
                    self._hold(adapter)
                else:
                    self._held.move_to_end(adapter_id)
                self.backend.set_adapter(slot, adapter)
            except BaseException:
                # this slot holds no (whole) adapter, the later ones still their old one
                for _, unwritten in writes[done:]:
                    self.slots.forget(unwritten)
                raise
            logger.debug("LoRA adapter %r written into slot %d", adapter.name, slot)
