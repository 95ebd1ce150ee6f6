"""The MLPs of the plugin's own NxDI classes on NxD's parallel layers: the gated MLP,
down(act(gate(x)) * up(x)) (families/gemma4, families/qwen3_5, and Qwen2.5-VL's vision
MLP in families/qwen2_vl, with biases), and an MoE block's experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from neuronx_distributed.modules.moe.moe_parallel_layers import (
    ExpertFusedColumnParallelLinear,
    ExpertFusedRowParallelLinear,
)
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


def dense_routing(chosen: torch.Tensor, weights: torch.Tensor, experts: int) -> torch.Tensor:
    """[tokens, experts] routing weights from each token's top-k experts `chosen` and
    their `weights` ([tokens, k] each; float32), zero off the top-k: no scatter, a
    comparison with every expert's index."""
    index = torch.arange(experts, device=chosen.device)
    picked = (chosen[..., None] == index).to(torch.float32)  # [tokens, k, experts]
    return (picked * weights[..., None]).sum(dim=1)


class EveryExpert(nn.Module):
    """An MoE block's experts as NxD's expert-fused parallel layers (gate_proj, up_proj
    [experts, hidden, inner], down_proj [experts, inner, hidden]): every expert on every
    token, each output weighted by its routing and summed in the hidden dtype. Static
    shapes and exact; its cost is experts / top-k times the routed experts' matmuls."""

    def __init__(
        self,
        config: InferenceConfig,
        experts: int,
        hidden: int,
        inner: int,
        act: Callable[[torch.Tensor], torch.Tensor],
    ):
        super().__init__()
        dtype, group = config.neuron_config.torch_dtype, get_tp_group(config)
        common = {"dtype": dtype, "tensor_model_parallel_group": group}
        self.gate_proj = ExpertFusedColumnParallelLinear(experts, hidden, inner, **common)
        self.up_proj = ExpertFusedColumnParallelLinear(experts, hidden, inner, **common)
        self.down_proj = ExpertFusedRowParallelLinear(experts, inner, hidden, **common)
        self.act = act

    def forward(self, tokens: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """tokens [n, hidden], routing [n, experts] -> [n, hidden]."""
        x = tokens[None]
        out = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # [E, n, hidden]
        weighted = (out * routing.t()[..., None]).to(tokens.dtype)
        return weighted.sum(dim=0)
