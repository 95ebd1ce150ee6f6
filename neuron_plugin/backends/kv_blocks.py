"""A request's KV blocks across the backend contract (prefill/decode disaggregation).

The block layout only: a vLLM block is NxDI's `pa_block_size` block, so a request's KV is
the blocks of its block table. `read_kv_blocks(block_ids)` answers them in one
layer-major tensor, K and V of every layer in one call:

    [layers, 2 (K, V), len(block_ids), block_size, kv_heads, head_dim]

in the backend's KV dtype. `kv_heads` is the model's KV heads, each once, whatever the
tensor parallelism: where NxDI replicates heads over ranks or pads them (its GQA
sharding, core.kv_heads) the nxd backend reads one copy of each and writes every copy
(backends/nxd/kv_state.py), so a block is the model's true KV size. Two servers exchange
blocks only when their geometries are equal, so the layout never needs converting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, known in TORCH_DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(
        f"a KV cache in {dtype} cannot be transferred: only {sorted(TORCH_DTYPES)} "
        f"caches can; serve with --dtype float32, bfloat16 or float16."
    )


@dataclass(frozen=True)
class KVGeometry:
    """What one KV block holds, for every layer."""

    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # a key of TORCH_DTYPES
    # How the backend computes the values (its name, and on nxd the NxDI patches that
    # change the math): blocks of another computation are not this cache's.
    computation: str

    def shape(self, blocks: int) -> tuple[int, ...]:
        return (self.layers, 2, blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, K and V of every layer."""
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return int(np.prod(self.shape(1))) * itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVGeometry:
        return cls(
            layers=int(values["layers"]),
            block_size=int(values["block_size"]),
            kv_heads=int(values["kv_heads"]),
            head_dim=int(values["head_dim"]),
            dtype=str(values["dtype"]),
            computation=str(values["computation"]),
        )


def require_block_layout(settings: NeuronSettings) -> None:
    if not settings.is_block_layout:
        raise NeuronConfigError(
            f"KV blocks exist in the block KV layout only, and this configuration uses the "
            f"{settings.kv_layout} layout ({settings.kv_layout_reason}); serve with "
            f"--enable-prefix-caching to transfer KV blocks."
        )


def checked_block_ids(
    block_ids: Sequence[int] | np.ndarray, settings: NeuronSettings
) -> np.ndarray:
    """The ids as int64, each a block a request can own: 1..num_blocks-1 (block 0 is
    vLLM's null block), at most a sequence's worth, no repeats."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    limit = settings.max_blocks_per_seq
    if ids.size == 0 or ids.size > limit:
        raise ValueError(
            f"{ids.size} KV blocks asked for; a request holds 1 to {limit} "
            f"(max_model_len {settings.max_model_len} / block_size {settings.block_size})"
        )
    bad = ids[(ids < 1) | (ids >= settings.num_blocks)]
    if bad.size:
        raise ValueError(
            f"KV block ids {bad.tolist()} are outside 1..{settings.num_blocks - 1} "
            f"(block 0 is vLLM's null block)"
        )
    if np.unique(ids).size != ids.size:
        raise ValueError(f"KV block ids {ids.tolist()} repeat a block")
    return ids


def block_runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """`ids` as runs of consecutive block ids: (first block id, blocks, position of the
    first in `ids`) each, in the order of `ids`. A backend whose cache cannot be indexed
    by a tensor of ids (NxD's device tensors) moves each run as one contiguous slice, so
    a move costs in the blocks moved and the runs, never in the cache's size."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    counts = np.diff(np.concatenate((starts, [ids.size])))
    return [(int(ids[a]), int(n), int(a)) for a, n in zip(starts, counts, strict=True)]


def check_blocks_tensor(geometry: KVGeometry, blocks: int, kv: torch.Tensor) -> None:
    """`kv` is `blocks` blocks of `geometry`, exactly."""
    expected = geometry.shape(blocks)
    if tuple(kv.shape) != expected or kv.dtype != geometry.torch_dtype:
        raise ValueError(
            f"KV blocks of shape {tuple(kv.shape)} in {kv.dtype} do not fit this backend's "
            f"cache: {blocks} blocks are {expected} in {geometry.torch_dtype}"
        )
