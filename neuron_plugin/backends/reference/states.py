"""A hybrid model's per-sequence state on the reference backend (Qwen3.5's gated DeltaNet
layers, core.recurrent_state): the conv and recurrent state tensors, mutated by the
graphs like the KV cache, and each call's slots into them.

- contiguous layout: a state slot per sequence slot (slot = seq_id), read unless the
  sequence starts in this call, and a scratch slot (max_num_seqs) for padding rows;
- block layout: a state slot per vLLM block id, as the call's `state_slots` name them
  (core.inputs.state_slots: the blocks the request owns in its state layers' KV cache
  groups); block 0, vLLM's null block, takes padding rows.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron_plugin.core.inputs import PAD_SEQ_ID, ForwardInputs
from neuron_plugin.core.recurrent_state import StateGeometry
from neuron_plugin.core.settings import NeuronSettings


class States:
    """See the module docstring."""

    def __init__(self, settings: NeuronSettings, geometry: StateGeometry, dtype: torch.dtype):
        self.settings = settings
        self.geometry = geometry
        self.dtype = dtype
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # allocated at load

    @property
    def slots(self) -> int:
        s = self.settings
        return s.num_blocks if s.is_block_layout else s.max_num_seqs + 1

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv (model dtype) and recurrent (float32) state tensors
        [state layers, slots, ...]."""
        shape = (len(self.geometry.layers), self.slots)
        return (
            torch.zeros((*shape, *self.geometry.conv_shape), dtype=self.dtype),
            torch.zeros((*shape, *self.geometry.recurrent_shape), dtype=torch.float32),
        )

    def load(self) -> None:
        self.tensors = self.empty()

    def describe(self) -> str:
        size = sum(t.numel() * t.element_size() for t in self.tensors or self.empty())
        where = "vLLM block" if self.settings.is_block_layout else "sequence slot"
        return (
            f"state of {len(self.geometry.layers)} state layers, {self.slots} slots (one per "
            f"{where}, {size / 2**20:.1f} MiB)"
        )

    def inputs(self, call: ForwardInputs | None, rows: int) -> dict[str, torch.Tensor]:
        """The graphs' state inputs for a call of `rows` rows (`call` None: a compile's
        example, zero tensors): each row's read and write slot per state layer ([rows, 2,
        state layers]: a read of -1 starts from zeros, a write of -1 goes to scratch),
        and the state tensors."""
        s = self.settings
        slots = np.full((rows, 2, len(self.geometry.layers)), -1, dtype=np.int64)
        if call is not None and call.state_slots is not None:
            if call.state_slots.shape != slots.shape:
                raise ValueError(
                    f"state_slots has shape {list(call.state_slots.shape)}; this call "
                    f"needs {list(slots.shape)}"
                )
            slots = call.state_slots.copy()
        elif call is not None and not s.is_block_layout:
            real = call.seq_ids != PAD_SEQ_ID
            slots[real, 1] = call.seq_ids[real, None]
            reads = real & (call.computed_context_lens > 0)
            slots[reads, 0] = call.seq_ids[reads, None]
        elif call is not None and call.num_real:
            raise ValueError(
                "a block-layout call of a hybrid model without state_slots; this is a "
                "plugin bug, please report it"
            )
        scratch = 0 if s.is_block_layout else s.max_num_seqs
        slots[:, 1] = np.where(slots[:, 1] < 0, scratch, slots[:, 1])
        conv, recurrent = self.empty() if call is None or self.tensors is None else self.tensors
        return {
            "state_slots": torch.from_numpy(slots),
            "conv_state": conv,
            "recurrent_state": recurrent,
        }
