"""LoRA on the reference backend: the adapter slot tensors every graph takes as inputs,
like the weights (core.lora). Zero at load (the base model's), an adapter's weights
written into a slot between calls, so adapters come and go without recompiling and a
compiled graph never holds one."""

from __future__ import annotations

from typing import Any

import torch

from neuron_plugin.core.adapters import AdapterWeights
from neuron_plugin.core.lora import LoraGeometry
from neuron_plugin.core.settings import NeuronSettings


class LoraSlots:
    """See the module docstring."""

    def __init__(self, settings: NeuronSettings, geometry: LoraGeometry, dtype: torch.dtype):
        self.settings = settings
        self.geometry = geometry
        self.dtype = dtype
        self.tensors: list[torch.Tensor] = []

    def shapes(self) -> list[list[int]]:
        """The slot tensors' shapes, in the graphs' `lora_weights` order: per layer, per
        target module, A [slots, rank, in] then B [slots, out, rank]."""
        slots, rank = self.settings.lora_slots, self.settings.max_lora_rank
        shapes = []
        for _ in range(self.geometry.num_layers):
            for module in self.settings.lora_target_modules:
                in_features, out_features = self.geometry.shapes[module]
                shapes += [[slots, rank, in_features], [slots, out_features, rank]]
        return shapes

    def clear(self) -> None:
        """Every slot zero (the base model's), for compiling and at load."""
        self.tensors = [torch.zeros(s, dtype=self.dtype) for s in self.shapes()]

    def inputs(self, adapter_slots: torch.Tensor) -> dict[str, Any]:
        """The graphs' LoRA keyword inputs: the slot tensors and each row's slot."""
        return {"lora_weights": self.tensors, "adapter_slots": adapter_slots}

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Write an adapter into slot `slot` (1..max_loras) of every slot tensor: its A
        and B zero-padded to the slots' rank, zero for the modules it does not train.
        Called between calls only, so no call in flight reads a half-written slot."""
        if not 1 <= slot <= self.settings.max_loras:
            raise ValueError(f"adapter slot {slot} is outside 1..{self.settings.max_loras}")
        tensors = iter(self.tensors)
        with torch.inference_mode():
            for layer in range(self.geometry.num_layers):
                for module in self.settings.lora_target_modules:
                    a_slots, b_slots = next(tensors), next(tensors)
                    a_slots[slot].zero_()
                    b_slots[slot].zero_()
                    if module in adapter.a:
                        rank = adapter.rank
                        a_slots[slot, :rank] = torch.from_numpy(adapter.a[module][layer])
                        b_slots[slot, :, :rank] = torch.from_numpy(adapter.b[module][layer])
