"""A parameter split by rows across the tensor-parallel ranks, for the plugin's own NxDI
classes' per-head and per-channel tables (Qwen3.5's DeltaNet A_log, dt_bias and
convolution weight). NxD shards a checkpoint only into its parallel layers' parameters
(trace.py shard_children, NxD 0.17 and 0.18: ColumnParallelLinear, ..., BaseParallelLinear)
that carry its tensor-parallel attributes; a plain nn.Parameter would get the whole tensor
on every rank and fail its shape check."""

from __future__ import annotations

import torch
from neuronx_distributed.parallel_layers.layers import BaseParallelLinear
from neuronx_distributed.parallel_layers.utils import set_tensor_model_parallel_attributes
from torch import nn


class ShardedRows(BaseParallelLinear):
    """`weight` [rows / tp_degree, *shape]: rank r holds rows r * rows / tp_degree on,
    as a column-parallel weight is split. Holds a table; it has no forward."""

    def __init__(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype, tp_degree: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros((rows // tp_degree, *shape), dtype=dtype))
        set_tensor_model_parallel_attributes(
            self.weight, is_parallel=True, dim=0, stride=1, num_partitions=tp_degree
        )
