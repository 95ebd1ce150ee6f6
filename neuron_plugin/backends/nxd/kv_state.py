"""NxDI's KV cache state tensors as KV blocks (`backends.kv_blocks`).

NxDI keeps the cache in `kv_mgr.past_key_values`, one tensor per layer and K/V in the
order K0, V0, K1, V1, ... (modules/kvcache/kv_cache_manager.py `KVCacheManager.__init__`,
NxDI 0.9 ef2731e lines 150-163). The plugin's block layout is NxDI's prefix-caching one
(`nxd/neuron_config.py` sets `is_prefix_caching` with `is_block_kv_layout`), whose
`BlockKVCacheManager._init_kv_shape_for_prefix_caching` (block_kv_cache_manager.py lines
48-77) shapes every tensor `(pa_num_blocks + 1, pa_block_size, kv_heads_per_rank,
head_dim)` (one reserved block takes padding writes), or, when a sequence spans fewer than
128 blocks and the block token-generation kernel is off, tiles the block dimension:
`(pa_num_blocks + 1, tiling_factor, pa_block_size // tiling_factor, heads, head_dim)`.
Writes scatter rows of `heads * head_dim` values at the flat slot `block * pa_block_size +
offset` in both shapes (`_update_cache_with_reshape`, lines 246-303), so viewing a tiled
tensor as `(blocks, pa_block_size, heads, head_dim)` addresses the same slots.

On a device the tensors are the per-rank state of NxD's traced model (`nxd_model.state`,
a dict per rank, as `NxDBackend.kv_cache_tensors`); with tensor parallelism each rank
holds `kv_heads_per_rank` heads and a block's heads are the ranks' in rank order. In
NxDI's CPU mode they are the eager submodels' `kv_mgr.past_key_values`, which NxDI
replaces after every call with the call's outputs in the context-encoding and
token-generation submodels (model_base.py `_copy_past_key_values`, lines 3761-3795): they
are looked up afresh on every access, and a write goes to every distinct tensor.

How blocks move: a device state tensor (`privateuseone:{rank}`, neuronx-distributed
trace/spmd.py `StateInitializer.forward`, which also makes K and V views of one
combined tensor under NEURON_COMBINE_KV_ALLOCATIONS) is read by NxDI itself only with
whole-tensor `.to("cpu")` copies (utils/debug_utils.py lines 68-72, utils/snapshot.py line
339). Gathering and scattering ops (`index_select`, `index_copy_`) cost time in the
whole cache's size on the device, device-to-device copies between different parent
tensors fail in the Neuron runtime, and device-to-host copies need contiguous tensors
(reported against SDK 2.31 on trn2). So every run of consecutive block ids
(`kv_blocks.block_runs`) moves as one `narrow` of the tensor's block view, which is
contiguous, copied to the host (`.cpu()`) or from a contiguous host tensor (`copy_`):
the cost is in the blocks and runs moved, never in the cache's size. The NxDI test
double's state tensors refuse everything else.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.kv_blocks import (
    KVGeometry,
    block_runs,
    check_blocks_tensor,
    dtype_name,
)
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

_NAME = re.compile(r"kv_mgr\.past_key_values\.(\d+)")


def _device_ranks(model: Any) -> list[list[torch.Tensor]]:
    """Per rank, its KV tensors in NxDI's order (K0, V0, K1, ...)."""
    ranks = []
    for state in model.context_encoding_model.model.nxd_model.state:
        found = {int(m.group(1)): t for name, t in state.items() if (m := _NAME.fullmatch(name))}
        ranks.append([found[i] for i in range(len(found))])
    return ranks


def _cpu_copies(model: Any) -> list[list[torch.Tensor]]:
    """Per KV index, every distinct tensor NxDI's CPU-mode submodels hold for it."""
    copies: list[list[torch.Tensor]] = []
    for wrapper in model.models:
        for i, param in enumerate(wrapper.model.kv_mgr.past_key_values):
            if i == len(copies):
                copies.append([])
            if all(param.data.data_ptr() != t.data_ptr() for t in copies[i]):
                copies[i].append(param.data)
    return copies


class NxDKVState:
    """Reads and writes KV blocks in an NxDI model's cache tensors (module docstring)."""

    def __init__(self, model: Any, settings: NeuronSettings, on_cpu: bool, computation: str):
        self.model = model
        self.settings = settings
        self.on_cpu = on_cpu
        self.computation = computation  # how the values are computed (KVGeometry)
        config = model.neuron_config
        if getattr(config, "kv_quant_config", None) is not None:
            raise NeuronConfigError(
                "override_neuron_config quantizes the KV cache (NxDI keeps per-layer "
                "scales beside it): its blocks cannot be transferred; remove the KV-cache "
                "quantization keys on a disaggregated server."
            )
        if not getattr(config, "is_prefix_caching", False):
            raise NeuronConfigError(
                "KV blocks are transferred in NxDI's prefix-caching block layout only; "
                "serve with --enable-prefix-caching."
            )

    def _ranks(self) -> list[list[torch.Tensor]]:
        if self.on_cpu:
            return [[copies[0] for copies in _cpu_copies(self.model)]]
        return _device_ranks(self.model)

    def _targets(self) -> list[list[list[torch.Tensor]]]:
        """Per KV index, per rank, every tensor a write must reach."""
        if self.on_cpu:
            return [[copies] for copies in _cpu_copies(self.model)]
        ranks = _device_ranks(self.model)
        return [[[rank[i]] for rank in ranks] for i in range(len(ranks[0]))]

    def geometry(self) -> KVGeometry:
        ranks = self._ranks()
        first = ranks[0][0]
        size, blocks = self.settings.block_size, self.settings.num_blocks
        block_dims = int(np.prod(first.shape[1:-2])) if first.dim() >= 4 else -1
        if first.dim() not in (4, 5) or first.shape[0] != blocks + 1 or block_dims != size:
            raise NeuronConfigError(
                f"NxDI's KV cache tensors have shape {tuple(first.shape)}, not the "
                f"prefix-caching block layout ({blocks + 1}, {size}, heads, head_dim) "
                f"(pa_num_blocks {blocks} plus NxDI's reserved block); this NxDI release "
                f"is not supported for KV transfer."
            )
        if len(ranks[0]) % 2:
            raise NeuronConfigError(
                f"NxDI holds {len(ranks[0])} KV cache tensors, not a K and a V per layer"
            )
        return KVGeometry(
            layers=len(ranks[0]) // 2,
            block_size=size,
            kv_heads=int(first.shape[-2]) * len(ranks),
            head_dim=int(first.shape[-1]),
            dtype=dtype_name(first.dtype),
            computation=self.computation,
        )

    def _blocks_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """(blocks, block_size, heads, head_dim), sharing the tensor's storage."""
        return tensor.view(tensor.shape[0], self.settings.block_size, *tensor.shape[-2:])

    @torch.inference_mode()  # the CPU mode's tensors are the outputs of inference calls
    def read(self, ids: np.ndarray) -> torch.Tensor:
        geometry = self.geometry()
        ranks = self._ranks()
        per_rank = geometry.kv_heads // len(ranks)
        out = torch.empty(
            (
                2 * geometry.layers,
                ids.size,
                geometry.block_size,
                geometry.kv_heads,
                geometry.head_dim,
            ),
            dtype=geometry.torch_dtype,
        )
        runs = block_runs(ids)
        for i in range(2 * geometry.layers):
            for r, rank in enumerate(ranks):
                blocks = self._blocks_view(rank[i])
                for first, count, at in runs:
                    heads = slice(r * per_rank, (r + 1) * per_rank)
                    out[i, at : at + count, :, heads] = blocks.narrow(0, first, count).cpu()
        return out.reshape(geometry.shape(ids.size))

    @torch.inference_mode()
    def write(self, ids: np.ndarray, kv: torch.Tensor) -> None:
        geometry = self.geometry()
        check_blocks_tensor(geometry, ids.size, kv)
        targets = self._targets()
        per_rank = geometry.kv_heads // len(targets[0])
        flat = kv.reshape(2 * geometry.layers, ids.size, geometry.block_size, *kv.shape[-2:])
        runs = block_runs(ids)
        for i, ranks in enumerate(targets):
            for r, copies in enumerate(ranks):
                for first, count, at in runs:
                    heads = slice(r * per_rank, (r + 1) * per_rank)
                    part = flat[i, at : at + count, :, heads].contiguous()
                    for tensor in copies:
                        self._blocks_view(tensor).narrow(0, first, count).copy_(part)
