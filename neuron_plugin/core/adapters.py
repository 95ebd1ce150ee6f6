"""LoRA adapters as data: an adapter's weights in the slot layout, the checks that refuse
one the compiled slots cannot hold, and which slot each adapter of a step takes.

`AdapterWeights` is what crosses the backend contract (`LoadedBackend.set_adapter`) and
the runner's shared memory: per target module an A array [layers, rank, in] and a B
array [layers, out, rank], float32, with the adapter's scaling (lora_alpha / r, or
rsLoRA's / sqrt(r), per module with rank_pattern / alpha_pattern) already multiplied into
B, so a backend computes y = W x + B (A x) for a row. Layers or modules the adapter does
not train are zero.

`AdapterSlots` hands out slots 1..max_loras (slot 0 is the base model's): an adapter
keeps its slot while it is there, a new one takes a free slot or the least recently used
one whose adapter the step does not need. vLLM's scheduler puts at most max_loras
distinct adapters into one step, so a step's adapters always fit.

Pure: no vLLM, torch or NxDI import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.lora import LoraGeometry

BASE_SLOT = 0


class AdapterError(NeuronConfigError):
    """An adapter the compiled slots cannot hold; the message names the adapter, the
    value and the limit."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter in the slot layout (see the module docstring)."""

    name: str
    adapter_id: int  # vLLM's lora_int_id
    path: str
    rank: int  # the largest rank of its modules; every array has this rank
    a: Mapping[str, np.ndarray] = field(default_factory=dict)  # module -> [layers, rank, in]
    b: Mapping[str, np.ndarray] = field(default_factory=dict)  # module -> [layers, out, rank]

    def arrays(self) -> dict[str, np.ndarray]:
        """Named arrays for the runner's arena."""
        return {
            **{f"{m}.A": a for m, a in self.a.items()},
            **{f"{m}.B": b for m, b in self.b.items()},
        }

    def describe(self) -> dict[str, object]:
        """The JSON-able fields beside the arrays."""
        return {
            "name": self.name,
            "adapter_id": self.adapter_id,
            "path": self.path,
            "rank": self.rank,
        }

    @classmethod
    def from_arrays(
        cls, fields: Mapping[str, object], arrays: Mapping[str, np.ndarray]
    ) -> AdapterWeights:
        a = {k.removesuffix(".A"): v for k, v in arrays.items() if k.endswith(".A")}
        b = {k.removesuffix(".B"): v for k, v in arrays.items() if k.endswith(".B")}
        if set(a) != set(b) or len(a) + len(b) != len(arrays):
            raise ValueError(f"adapter arrays {sorted(arrays)} are not A/B pairs per module")
        return cls(
            name=str(fields["name"]),
            adapter_id=int(fields["adapter_id"]),  # type: ignore[call-overload]  # JSON int
            path=str(fields["path"]),
            rank=int(fields["rank"]),  # type: ignore[call-overload]  # JSON int
            a=a,
            b=b,
        )

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays().values())


@dataclass
class LayerWeights:
    """One trained module of one layer, as a PEFT checkpoint holds it."""

    layer: int
    module: str
    lora_a: np.ndarray  # [rank, in]
    lora_b: np.ndarray  # [out, rank]
    scaling: float


def _refuse(name: str, path: str, problem: str, fix: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {name!r} ({path}): {problem}; {fix}.")


def build_adapter(
    name: str,
    adapter_id: int,
    path: str,
    layers: Iterable[LayerWeights],
    geometry: LoraGeometry,
    max_lora_rank: int,
) -> AdapterWeights:
    """The slot layout of an adapter's modules, refusing what the compiled slots cannot
    hold: a module not compiled in, a layer the model does not have, shapes of another
    base model (checked before the rank, which only well-shaped weights have), or a rank
    above max_lora_rank."""
    given = list(layers)
    if not given:
        raise _refuse(name, path, "it holds no LoRA weights", "check adapter_model.safetensors")
    outside = sorted({w.module for w in given} - set(geometry.shapes))
    if outside:
        raise _refuse(
            name,
            path,
            f"it trains {', '.join(outside)}, which {'has' if len(outside) == 1 else 'have'} "
            f"no compiled LoRA slots (target modules {', '.join(geometry.shapes)})",
            f"restart with --lora-target-modules including {' '.join(outside)}",
        )
    for w in given:
        _check_module(name, path, w, geometry)
    rank = max(w.lora_a.shape[0] for w in given)
    if rank > max_lora_rank:
        raise _refuse(
            name,
            path,
            f"rank {rank} is above --max-lora-rank {max_lora_rank} (the slots' rank)",
            f"restart with --max-lora-rank {rank} or more",
        )
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    for w in given:
        in_features, out_features = geometry.shapes[w.module]
        r = w.lora_a.shape[0]
        if w.module not in a:
            a[w.module] = np.zeros((geometry.num_layers, rank, in_features), dtype=np.float32)
            b[w.module] = np.zeros((geometry.num_layers, out_features, rank), dtype=np.float32)
        a[w.module][w.layer, :r] = w.lora_a
        b[w.module][w.layer, :, :r] = w.lora_b * np.float32(w.scaling)
    return AdapterWeights(name, adapter_id, path, rank, a, b)


def _check_module(name: str, path: str, w: LayerWeights, geometry: LoraGeometry) -> None:
    if not 0 <= w.layer < geometry.num_layers:
        raise _refuse(
            name,
            path,
            f"it trains layer {w.layer}, the model has {geometry.num_layers} layers",
            "use an adapter trained for this base model",
        )
    in_features, out_features = geometry.shapes[w.module]
    r = w.lora_b.shape[1] if w.lora_b.ndim == 2 else -1
    if w.lora_a.shape == (r, in_features) and w.lora_b.shape == (out_features, r):
        return
    transposed = w.lora_a.shape == (in_features, r) and w.lora_b.shape == (out_features, r)
    raise _refuse(
        name,
        path,
        f"layer {w.layer} {w.module} has lora_A {list(w.lora_a.shape)} and lora_B "
        f"{list(w.lora_b.shape)}; the model's {w.module} needs lora_A [r, {in_features}] "
        f"and lora_B [{out_features}, r] with one r"
        + (f" (this lora_A is transposed: [{in_features}, {r}])" if transposed else ""),
        "save lora_A as [r, in_features]"
        if transposed
        else "use an adapter trained for this base model",
    )


class AdapterSlots:
    """Which adapter (by vLLM's lora_int_id) each slot 1..count holds (see the module
    docstring)."""

    def __init__(self, count: int):
        self.count = count
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slots.get(adapter_id)

    def adapter_ids(self) -> set[int]:
        """The adapters in a slot."""
        return set(self._slots)

    def forget(self, adapter_id: int) -> None:
        """The adapter's weights changed (reloaded in place): its slot is stale."""
        self._slots.pop(adapter_id, None)

    def assign(self, needed: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """(adapter id -> slot for every needed adapter, the (slot, adapter id) writes to
        do first): a needed adapter keeps its slot; one without takes a free slot, else
        the least recently used slot whose adapter this step does not need."""
        wanted = list(dict.fromkeys(needed))
        if len(wanted) > self.count:
            raise RuntimeError(
                f"a step needs {len(wanted)} LoRA adapters, more than --max-loras "
                f"{self.count} slots; vLLM's scheduler never schedules that many: report "
                f"this with the engine log"
            )
        for adapter_id in wanted:
            if adapter_id in self._slots:
                self._slots.move_to_end(adapter_id)
        writes = []
        for adapter_id in wanted:
            if adapter_id in self._slots:
                continue
            used = set(self._slots.values())
            free = [s for s in range(1, self.count + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(a for a in self._slots if a not in wanted)
                slot = self._slots.pop(victim)
            self._slots[adapter_id] = slot
            writes.append((slot, adapter_id))
        return {a: self._slots[a] for a in wanted}, writes


def row_slots(adapter_ids: np.ndarray, slots: Mapping[int, int]) -> np.ndarray:
    """Each row's slot: its adapter's, or BASE_SLOT for rows without one (id 0)."""
    out = np.full(adapter_ids.shape, BASE_SLOT, dtype=np.int64)
    for adapter_id, slot in slots.items():
        out[adapter_ids == adapter_id] = slot
    return out
