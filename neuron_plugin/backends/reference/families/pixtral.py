"""Pixtral in transformers' Llava format: a Mistral decoder (`ARCHITECTURES`), and
Pixtral's vision tower and Llava's projector (Pixtral in transformers' Llava format,
as mistral-community/pixtral-12b ships it) as one fixed-shape function of (weights,
patches), one graph per vision bucket: the same inputs as the Qwen2-VL family's graph
(`reference.vision`), so the backend runs either alike.

An image arrives as its patches, row by row (core.vision.pixtral_patches: channels x
patch x patch values each, the order of patch_conv's kernel), with no merging: one
embedding per patch. `rotary_ids` are each patch's (row, column), `groups[0]` its image
(-1: padding; a patch attends to its own image's patches only, transformers'
generate_block_attention_mask). The patch embedding, a Conv2d without bias whose kernel
equals its stride, is a linear map over the flattened patch; then ln_pre, the blocks
(RMSNorm, attention with 2-D RoPE, RMSNorm, gated MLP) and the projector (linear, GELU,
linear) on the last block's output (vision_feature_layer -1, strategy "full"), as
transformers' `modeling_pixtral.py` (PixtralVisionModel, PixtralVisionRotaryEmbedding:
rows rotate at the even frequencies of head_dim, columns at the odd ones) and
`modeling_llava.py` (LlavaMultiModalProjector) compute them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from neuron_plugin.backends.reference.architecture import Architecture, UnsupportedModelError
from neuron_plugin.backends.reference.layers import rms_norm
from neuron_plugin.backends.reference.mlp import activation
from neuron_plugin.backends.reference.patch_attention import patch_attention
from neuron_plugin.backends.reference.patch_layout import patch_inputs

TOWER = "vision_tower."
PROJECTOR = "multi_modal_projector."
NORM_EPS = 1e-5  # transformers' PixtralRMSNorm in the tower


ARCHITECTURES = {
    "LlavaForConditionalGeneration": Architecture(
        "pixtral", attention_bias="none", reads_layer_types=False, vision=True, mrope=False
    )
}


def tower(config: dict[str, Any]) -> PixtralSpec:
    vision = config.get("vision_config")
    kind = vision.get("model_type") if isinstance(vision, dict) else None
    if kind != "pixtral":
        raise UnsupportedModelError(
            f"LlavaForConditionalGeneration with a {kind!r} vision tower: the reference "
            f"backend runs Llava with Pixtral's (vision_config model_type 'pixtral') only"
        )
    return PixtralSpec.from_hf_config(config)


@dataclass(frozen=True)
class PixtralSpec:
    """The vision tower's and projector's facts, from config.json."""

    depth: int
    embed_dim: int
    num_heads: int
    head_dim: int
    activation: str
    patch_dim: int  # channels x patch x patch
    rope_theta: float
    projector_activation: str
    projector_bias: bool
    embedding_width: int  # the text decoder's hidden size: the projector's output per patch
    # what the backend shares with the Qwen2-VL family's VisionSpec: no merging, no windows
    spatial_merge_size: int = 1
    merge_patches: int = 1
    window: int = 0

    def image_inputs(self, grid_thw: np.ndarray, patches: int) -> list[np.ndarray]:
        """What the graph takes of an image's grid, padded to `patches`: each patch's
        (row, column) and its image (`patch_layout.patch_inputs`, one frame)."""
        return list(patch_inputs(grid_thw, 1, patches))

    def graph(self) -> PixtralGraph:
        return PixtralGraph(self)

    def weight_names(self) -> list[str]:
        return weight_names(self)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> PixtralSpec:
        vision: dict[str, Any] = config["vision_config"]
        layer = config.get("vision_feature_layer", -1)
        strategy = config.get("vision_feature_select_strategy", "full")
        if layer != -1 or strategy != "full":
            raise UnsupportedModelError(
                f"Pixtral with vision_feature_layer={layer!r} and "
                f"vision_feature_select_strategy={strategy!r}: the reference backend runs "
                f"the last layer's features of every patch (-1, 'full'), as Pixtral ships"
            )
        heads = int(vision["num_attention_heads"])
        embed = int(vision["hidden_size"])
        params = vision.get("rope_parameters") or {}
        patch = int(vision["patch_size"])
        return cls(
            depth=int(vision["num_hidden_layers"]),
            embed_dim=embed,
            num_heads=heads,
            head_dim=int(vision.get("head_dim") or embed // heads),
            activation=vision.get("hidden_act", "gelu"),  # PixtralVisionConfig's default
            patch_dim=int(vision.get("num_channels", 3)) * patch * patch,
            rope_theta=float(params.get("rope_theta", vision.get("rope_theta", 10000.0))),
            projector_activation=config.get("projector_hidden_act", "gelu"),
            projector_bias=bool(config.get("multimodal_projector_bias", True)),
            embedding_width=int((config.get("text_config") or config)["hidden_size"]),
        )


def weight_names(spec: PixtralSpec) -> list[str]:
    """The graph's weight inputs, in order (the checkpoint's names)."""
    names = [TOWER + "patch_conv.weight", TOWER + "ln_pre.weight"]
    for i in range(spec.depth):
        p = f"{TOWER}transformer.layers.{i}."
        names += [p + "attention_norm.weight"]
        names += [f"{p}attention.{x}_proj.weight" for x in "qkvo"]
        names += [p + "ffn_norm.weight"]
        names += [f"{p}feed_forward.{x}_proj.weight" for x in ("gate", "up", "down")]
    bias = (".bias",) if spec.projector_bias else ()
    for module in ("linear_1", "linear_2"):
        names += [f"{PROJECTOR}{module}{x}" for x in (".weight", *bias)]
    return names


class PixtralGraph(nn.Module):
    """Pixtral's tower and projector over one bucket of patches (module docstring)."""

    def __init__(self, spec: PixtralSpec):
        super().__init__()
        self.spec = spec
        self.names = weight_names(spec)
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta**exponents)  # [head_dim / 2]
        self.inv_freq: torch.Tensor  # [2, head_dim / 4]: rows' (even), columns' (odd)
        self.register_buffer("inv_freq", torch.stack([inv_freq[0::2], inv_freq[1::2]]))

    def forward(
        self,
        weights: list[torch.Tensor],
        pixel_values: torch.Tensor,
        rotary_ids: torch.Tensor,
        groups: torch.Tensor,
    ) -> torch.Tensor:
        s = self.spec
        w = dict(zip(self.names, weights, strict=True))
        patch_weight = w[TOWER + "patch_conv.weight"]
        dtype = patch_weight.dtype
        x = pixel_values.to(dtype) @ patch_weight.reshape(s.embed_dim, -1).t()
        x = rms_norm("rms", x, w[TOWER + "ln_pre.weight"], NORM_EPS)

        freqs = (rotary_ids.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [n, hd / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
        frame = groups[0]
        visible = (frame.unsqueeze(1) == frame.unsqueeze(0)) & (frame >= 0).unsqueeze(0)

        for i in range(s.depth):
            p = f"{TOWER}transformer.layers.{i}."
            h = rms_norm("rms", x, w[p + "attention_norm.weight"], NORM_EPS)
            x = x + self._attention(w, p + "attention.", h, cos, sin, visible)
            h = rms_norm("rms", x, w[p + "ffn_norm.weight"], NORM_EPS)
            f = p + "feed_forward."
            gated = activation(s.activation, self._linear(w, f + "gate_proj", h))
            x = x + self._linear(w, f + "down_proj", gated * self._linear(w, f + "up_proj", h))

        h = activation(s.projector_activation, self._linear(w, PROJECTOR + "linear_1", x))
        return self._linear(w, PROJECTOR + "linear_2", h)

    def _attention(
        self,
        w: dict[str, torch.Tensor],
        p: str,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        s = self.spec
        n = x.shape[0]
        q, k, v = (
            self._linear(w, f"{p}{name}_proj", x).reshape(n, s.num_heads, s.head_dim)
            for name in "qkv"
        )
        return self._linear(w, p + "o_proj", patch_attention(q, k, v, cos, sin, visible))

    @staticmethod
    def _linear(w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, w[module + ".weight"], w.get(module + ".bias"))
