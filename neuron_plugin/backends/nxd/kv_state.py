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

How heads move: with tensor parallelism NxDI keeps its own GQA sharding of the KV heads
(core.kv_heads, modules/attention/gqa.py get_shardable_head_counts): where the TP degree
exceeds the KV heads each head is replicated over several ranks (Llama-3-8B at TP 32: on
4 ranks each), and where it is no multiple of them NxDI converts to multi-head attention
with padding heads (Llama-3-8B at TP 12: 36 KV heads, 3 a rank). A block's payload holds
each of the model's KV heads once (`geometry().kv_heads` is the model's count, whatever
the TP degree): a read copies the fewest ranks that hold every head (one rank per
replica group where a rank holds one head), a write reaches every rank, each replica
written and the padding heads zeroed (their K and V are zero in NxDI, whose padded
k_proj/v_proj rows are zero: gqa.py maybe_pad_tail).

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
the cost is in the blocks and runs moved, never in the cache's size. Each rank's copies
(2 x layers x runs) are issued by a thread of its own, the ranks side by side (each is
its own NeuronCore), so the copies one after another do not grow with the TP degree.
The NxDI test double's state tensors refuse everything else.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.kv_blocks import (
    KVGeometry,
    block_runs,
    check_blocks_tensor,
    dtype_name,
)
from neuron_plugin.core.gemma4 import is_gemma4
from neuron_plugin.core.kv_heads import HeadSharding, model_head_sharding
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


def read_plan(sharding: HeadSharding) -> list[tuple[int, list[tuple[int, int]]]]:
    """The fewest ranks whose KV heads are every model head (greedy set cover, lowest
    rank first on a tie), each with (its local head index, the model head) per head it
    contributes: one rank per replica group where a rank holds one head."""
    per = sharding.kv_heads_per_core
    held = [
        {h: local for local, h in enumerate(sharding.slot_heads[r * per : (r + 1) * per])}
        for r in range(sharding.tp_degree)
    ]
    missing = set(range(sharding.kv_heads))
    plan = []
    while missing:
        rank = max(range(len(held)), key=lambda r: (len(missing & held[r].keys()), -r))
        heads = sorted(missing & held[rank].keys())
        plan.append((rank, [(held[rank][h], h) for h in heads]))
        missing -= set(heads)
    return sorted(plan)


def write_heads(sharding: HeadSharding) -> list[tuple[int, ...]]:
    """Per rank, the model head each of its KV heads copies; the model's head count for
    a padding head (a zero head appended to the payload)."""
    per = sharding.kv_heads_per_core
    slots = [sharding.kv_heads if h is None else h for h in sharding.slot_heads]
    return [tuple(slots[r * per : (r + 1) * per]) for r in range(sharding.tp_degree)]


class NxDKVState:
    """Reads and writes KV blocks in an NxDI model's cache tensors (module docstring).
    `hf_config`: the checkpoint's config, whose heads NxDI shards; `computation`: how
    the values are computed (KVGeometry)."""

    def __init__(
        self,
        model: Any,
        settings: NeuronSettings,
        on_cpu: bool,
        hf_config: Mapping[str, Any],
        computation: str,
    ):
        self.model = model
        self.settings = settings
        self.on_cpu = on_cpu
        self.computation = computation  # how the values are computed (KVGeometry)
        if is_gemma4(hf_config):
            raise NeuronConfigError(
                "Gemma 4 on the nxd backend with --kv-transfer-config: the plugin's Gemma 4 "
                "class packs each writing layer's keys and values into cache rows of its "
                "own width (core.gemma4: sliding and full layers differ in KV heads and "
                "head size), which the transfer's blocks of [KV heads, head_dim] per layer "
                "do not describe; serve it without --kv-transfer-config."
            )
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
        # NxDI's CPU mode runs one rank (core.nxdi_cpu_mode refuses TP > 1)
        self.sharding = model_head_sharding(hf_config, 1 if on_cpu else settings.tp_degree)

    def _ranks(self) -> list[list[torch.Tensor]]:
        """Per rank, its KV tensors in NxDI's order (K0, V0, K1, ...)."""
        if self.on_cpu:
            return [[copies[0] for copies in _cpu_copies(self.model)]]
        return _device_ranks(self.model)

    def _targets(self) -> list[list[list[torch.Tensor]]]:
        """Per rank, per KV index, every tensor a write must reach."""
        if self.on_cpu:
            return [_cpu_copies(self.model)]
        return [[[tensor] for tensor in rank] for rank in _device_ranks(self.model)]

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
        sharding = self.sharding
        if len(ranks) != sharding.tp_degree or first.shape[-2] != sharding.kv_heads_per_core:
            raise NeuronConfigError(
                f"NxDI's KV cache holds {first.shape[-2]} heads on each of {len(ranks)} "
                f"ranks, not NxDI's GQA sharding of the model ({sharding.describe()}); "
                f"its KV blocks cannot be transferred (attention data parallelism or "
                f"flash decoding change the sharding): turn those off on a "
                f"disaggregated server."
            )
        return KVGeometry(
            layers=len(ranks[0]) // 2,
            block_size=size,
            kv_heads=sharding.kv_heads,
            head_dim=int(first.shape[-1]),
            dtype=dtype_name(first.dtype),
            computation=self.computation,
        )

    def _blocks_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """(blocks, block_size, heads, head_dim), sharing the tensor's storage."""
        return tensor.view(tensor.shape[0], self.settings.block_size, *tensor.shape[-2:])

    @staticmethod
    def _each_rank(jobs: list[Callable[[], None]]) -> None:
        """Run each rank's copies on a thread of its own, side by side (a copy blocks the
        thread that issues it); the first error is raised once all are done."""
        if len(jobs) == 1:
            jobs[0]()
            return
        errors: list[BaseException] = []

        def guarded(job: Callable[[], None]) -> None:
            try:
                job()
            except BaseException as exc:  # raised in the caller's thread below
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    @torch.inference_mode()  # the CPU mode's tensors are the outputs of inference calls
    def read(self, ids: np.ndarray) -> torch.Tensor:
        geometry = self.geometry()
        ranks = self._ranks()
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

        def read_rank(rank: int, picks: list[tuple[int, int]]) -> Callable[[], None]:
            def run() -> None:
                with torch.inference_mode():
                    for i, tensor in enumerate(ranks[rank]):
                        blocks = self._blocks_view(tensor)
                        for first, count, at in runs:
                            host = blocks.narrow(0, first, count).cpu()
                            for local, head in picks:
                                out[i, at : at + count, :, head] = host[:, :, local]

            return run

        self._each_rank([read_rank(rank, picks) for rank, picks in read_plan(self.sharding)])
        return out.reshape(geometry.shape(ids.size))

    @torch.inference_mode()
    def write(self, ids: np.ndarray, kv: torch.Tensor) -> None:
        geometry = self.geometry()
        check_blocks_tensor(geometry, ids.size, kv)
        targets = self._targets()
        flat = kv.reshape(2 * geometry.layers, ids.size, geometry.block_size, *kv.shape[-2:])
        # the model's heads and a zero head (padding), then each distinct rank's heads
        # contiguous on the host, built once however many replicas take them
        heads = torch.cat((flat, flat.new_zeros((*flat.shape[:3], 1, flat.shape[-1]))), dim=3)
        parts = {h: heads[:, :, :, list(h)] for h in set(write_heads(self.sharding))}
        runs = block_runs(ids)

        def write_rank(rank: int, part: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                with torch.inference_mode():
                    for i, copies in enumerate(targets[rank]):
                        for first, count, at in runs:
                            for tensor in copies:
                                self._blocks_view(tensor).narrow(0, first, count).copy_(
                                    part[i, at : at + count]
                                )

            return run

        self._each_rank(
            [write_rank(rank, parts[h]) for rank, h in enumerate(write_heads(self.sharding))]
        )
