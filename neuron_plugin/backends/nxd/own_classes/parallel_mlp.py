"""The gated MLP, down(act(gate(x)) * up(x)), on NxD's column/row parallel layers: the
dense MLP of the plugin's own NxDI classes (families/gemma4, families/qwen3_5), and
Qwen2.5-VL's vision MLP (families/qwen2_vl, with biases)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.utils.distributed import get_tp_group
from torch import nn


class GatedMLP(nn.Module):
    """gate_proj, up_proj (column parallel) and down_proj (row parallel), named as the
    checkpoints name them."""

    def __init__(
        self,
        config: InferenceConfig,
        hidden: int,
        width: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = False,
    ):
        super().__init__()
        dtype, group = config.neuron_config.torch_dtype, get_tp_group(config)
        common = {"bias": bias, "dtype": dtype, "pad": True, "tensor_model_parallel_group": group}
        self.gate_proj = ColumnParallelLinear(hidden, width, gather_output=False, **common)
        self.up_proj = ColumnParallelLinear(hidden, width, gather_output=False, **common)
        self.down_proj = RowParallelLinear(width, hidden, input_is_parallel=True, **common)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
