"""The decoder's MLPs: the gated MLP and the mixture-of-experts kinds, in fixed shapes.

MoE layers compute every expert for every token (dense: [tokens, experts, ...]) and weigh
them with the router's weights scattered to a [tokens, experts] matrix that is zero off
the chosen top-k, so the graph has no data-dependent shapes. Routing follows transformers
per architecture:
- Mixtral: softmax over all experts (float32), top-k, renormalised to sum 1;
- Qwen3-MoE: the same, renormalised only with norm_topk_prob, weights cast back to the
  hidden dtype; its mlp_only_layers / decoder_sparse_step layers are dense MLPs;
- gpt-oss: top-k of the router logits (the router has a bias), softmax over those k;
  experts have biases, gate and up interleaved in one tensor, clamped to swiglu_limit,
  and the activation (up + 1) * gate * sigmoid(alpha * gate);
- Llama 4: the top-k router logits' sigmoids (0 for the other experts) scale each
  expert's INPUT, experts' gate and up fused in one [hidden, 2 x inner] tensor (gate the
  first half), and a shared expert (a gated MLP) on every token adds to their sum; its
  dense layers' MLP is in `feed_forward` (Architecture.mlp_module).
Per-expert checkpoint tensors (`experts.{e}.w1.weight`, the Hub's layout) are stacked at
load into one [experts, ...] graph input named with `*` for the expert index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional

if TYPE_CHECKING:  # the vision towers import `activation` from the families' modules
    from neuron_plugin.backends.reference.architectures import DecoderSpec


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' ACT2FN for the activations the served architectures use."""
    if name == "silu":
        return functional.silu(x)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return functional.gelu(x, approximate="tanh")
    if name == "gelu":
        return functional.gelu(x)
    if name == "quick_gelu":  # Qwen2-VL's vision tower
        return x * torch.sigmoid(1.702 * x)
    raise ValueError(f"activation {name!r} is not implemented by the reference decoder")


@dataclass(frozen=True)
class MoeKind:
    """Checkpoint names of one MoE kind, relative to the layer prefix; `{e}` marks
    per-expert tensors that the graph takes stacked."""

    router: str
    router_bias: str | None
    # swiglu: gate, up, down; gpt-oss: gate_up(+bias), down(+bias); Llama 4: gate_up,
    # down, then the shared expert's gate, up, down
    experts: tuple[str, ...]


MOE_KINDS = {
    "mixtral": MoeKind(
        "block_sparse_moe.gate.weight",
        None,
        (
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
            "block_sparse_moe.experts.{e}.w2.weight",
        ),
    ),
    "qwen3_moe": MoeKind(
        "mlp.gate.weight",
        None,
        (
            "mlp.experts.{e}.gate_proj.weight",
            "mlp.experts.{e}.up_proj.weight",
            "mlp.experts.{e}.down_proj.weight",
        ),
    ),
    "llama4": MoeKind(
        "feed_forward.router.weight",
        None,
        (
            "feed_forward.experts.gate_up_proj",
            "feed_forward.experts.down_proj",
            "feed_forward.shared_expert.gate_proj.weight",
            "feed_forward.shared_expert.up_proj.weight",
            "feed_forward.shared_expert.down_proj.weight",
        ),
    ),
    "gpt_oss": MoeKind(
        "mlp.router.weight",
        "mlp.router.bias",
        (
            "mlp.experts.gate_up_proj",
            "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias",
        ),
    ),
}
DENSE = ("gate_proj", "up_proj", "down_proj")


def mlp_weights(spec: DecoderSpec, layer: int) -> list[tuple[str, tuple[str, ...]]]:
    """(graph input name, checkpoint tensors stacked into it) of a layer's MLP."""
    prefix = f"model.layers.{layer}."
    if not spec.moe_layers[layer]:
        names = [f"{prefix}{spec.arch.mlp_module}.{n}.weight" for n in DENSE]
        return [(n, (n,)) for n in names]
    kind = MOE_KINDS[spec.arch.mlp]
    names = [kind.router] + ([kind.router_bias] if kind.router_bias else []) + list(kind.experts)
    return [
        (
            prefix + n.replace("{e}", "*"),
            tuple(prefix + n.format(e=e) for e in range(spec.num_experts))
            if "{e}" in n
            else (prefix + n,),
        )
        for n in names
    ]


# A LoRA delta for (module name, its input), None where the module carries no slots.
Adapt = Callable[[str, torch.Tensor], "torch.Tensor | None"]
# A projection of a quantized checkpoint: (module path, its input) -> x W^T, its int8
# weight scaled per output channel after the matmul (see decoder.DecoderGraph.linear).
Linear = Callable[[str, torch.Tensor], torch.Tensor]


def _plus(y: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    return y if delta is None else y + delta


def mlp(
    spec: DecoderSpec,
    weights: dict[str, torch.Tensor],
    layer: int,
    h: torch.Tensor,
    adapt: Adapt | None = None,
    linear: Linear | None = None,
) -> torch.Tensor:
    """Layer `layer`'s MLP on h [batch, active, hidden]; `adapt` adds each row's LoRA
    delta to the dense MLP's projections (LoRA slots exist for dense MLPs only);
    `linear` computes a quantized checkpoint's dense projections."""
    if linear is not None and not spec.moe_layers[layer]:
        prefix = f"model.layers.{layer}.{spec.arch.mlp_module}."
        inner = activation(
            spec.activation, _plus(linear(prefix + "gate_proj", h), adapt and adapt("gate_proj", h))
        )
        inner = inner * _plus(linear(prefix + "up_proj", h), adapt and adapt("up_proj", h))
        return _plus(linear(prefix + "down_proj", inner), adapt and adapt("down_proj", inner))
    w = [weights[name] for name, _ in mlp_weights(spec, layer)]
    if not spec.moe_layers[layer]:
        gate, up, down = w
        if adapt is None:
            return _gated(spec, h, gate, up, down)
        inner = activation(spec.activation, _plus(h @ gate.t(), adapt("gate_proj", h)))
        inner = inner * _plus(h @ up.t(), adapt("up_proj", h))
        return _plus(inner @ down.t(), adapt("down_proj", inner))
    x = h.reshape(1, -1, spec.hidden_size)  # [1, tokens, hidden], broadcast over experts
    if spec.arch.mlp == "gpt_oss":
        router, router_bias, gate_up, gate_up_bias, down, down_bias = w
        routing = _gpt_oss_routing(spec, functional.linear(x[0], router, router_bias))
        out = _gpt_oss_experts(spec, x, gate_up, gate_up_bias, down, down_bias)
    elif spec.arch.mlp == "llama4":
        return _llama4_moe(spec, h, *w)
    else:
        router, gate, up, down = w
        routing = _softmax_routing(spec, functional.linear(x[0], router))
        inner = activation(spec.activation, x @ gate.transpose(1, 2)) * (x @ up.transpose(1, 2))
        out = inner @ down.transpose(1, 2)  # [experts, tokens, hidden]
    # Each expert's weighted output in the hidden dtype, summed in expert order (the
    # unchosen experts' zeros add nothing), as transformers' index_add does.
    combined = (out * routing.t().unsqueeze(-1)).to(h.dtype).sum(dim=0)
    return combined.view(h.shape)


def _gated(
    spec: DecoderSpec, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The gated MLP: down(act(gate h) * up h)."""
    return (activation(spec.activation, h @ gate.t()) * (h @ up.t())) @ down.t()


def _llama4_moe(
    spec: DecoderSpec,
    h: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *shared: torch.Tensor,
) -> torch.Tensor:
    """transformers' Llama4TextMoe: each expert's input is h times the sigmoid of its
    router logit if in the top-k (else 0), all experts' outputs summed in the hidden
    dtype onto the shared expert's."""
    x = h.reshape(-1, spec.hidden_size)  # [tokens, hidden]
    logits = x @ router.t()
    values, indices = torch.topk(logits, spec.experts_per_token, dim=-1)
    chosen = torch.full_like(logits, float("-inf")).scatter(1, indices, values)
    scores = torch.sigmoid(chosen.float()).to(x.dtype)  # [tokens, experts]
    routed = x.unsqueeze(0) * scores.t().unsqueeze(-1)  # [experts, tokens, hidden]
    gate, up = (routed @ gate_up).split(down.shape[1], dim=-1)
    experts = (up * activation(spec.activation, gate)) @ down
    return (_gated(spec, x, *shared) + experts.sum(dim=0)).view(h.shape)


def _dense(values: torch.Tensor, indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Top-k (values, indices) [tokens, k] -> [tokens, experts], zero off the top-k."""
    chosen = indices.unsqueeze(-1) == torch.arange(experts, dtype=indices.dtype)
    return (chosen.to(values.dtype) * values.unsqueeze(-1)).sum(dim=1)


def _softmax_routing(spec: DecoderSpec, logits: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = torch.topk(probs, spec.experts_per_token, dim=-1)
    if spec.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    if spec.arch.mlp == "qwen3_moe":
        values = values.to(logits.dtype)
    return _dense(values, indices, spec.num_experts)


def _gpt_oss_routing(spec: DecoderSpec, logits: torch.Tensor) -> torch.Tensor:
    values, indices = torch.topk(logits, spec.experts_per_token, dim=-1)
    return _dense(torch.softmax(values, dim=-1), indices, spec.num_experts)


def _gpt_oss_experts(
    spec: DecoderSpec,
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
) -> torch.Tensor:
    fused = x @ gate_up + gate_up_bias.unsqueeze(1)  # [experts, tokens, 2 * inner]
    gate = fused[..., ::2].clamp(max=spec.swiglu_limit)
    up = fused[..., 1::2].clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    glu = gate * torch.sigmoid(gate * spec.swiglu_alpha)
    return ((up + 1) * glu) @ down + down_bias.unsqueeze(1)
