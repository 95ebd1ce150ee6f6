"""The vision towers of the Qwen2-VL family and Qwen3-VL as one fixed-shape function of
(weights, patches), one graph per vision bucket (core.vision).

An image arrives as its processor's flattened patches (channels x temporal x patch x
patch values each), already in merge-block order: every spatial_merge_size**2
consecutive patches form one merged embedding. What depends on the image's grid is
computed on the host (`patch_layout`, numpy) and enters the graph as inputs, so one graph
serves every grid of at most its bucket's patches:
  pixel_values: [patches, patch_dim]   the image's patches, zero rows after the real ones
  rotary_ids:   [patches, 2]           each patch's (row, column) in the grid
  groups:       [2, patches]           each patch's attention group: its frame (full
                                       attention) and its window (Qwen2.5-VL's windowed
                                       blocks; the frame again for Qwen2-VL); -1: padding
  taps, tap_weights: [patches, 4]      Qwen3-VL: the four rows of its learned position
                                       grid each patch interpolates (bilinear, corners
                                       aligned) and their weights; zero for padding
A patch attends to the patches of its group (transformers' cu_seqlens /
cu_window_seqlens) and never to padding; the padded rows compute garbage that
`LoadedBackend.encode_image` drops. Qwen2.5-VL reorders patches window by window before
its blocks and back after its merger (whole merge groups both times): attention within a
group and the merger are indifferent to that order, so the graph keeps the processor's.
The graph answers [patches / merge**2, text hidden] embeddings (PatchMerger); Qwen3-VL's
also carry, concatenated after them, the DeepStack mergers' outputs of the blocks in
deepstack_visual_indexes ([patches / merge**2, text hidden x (1 + levels)], as vLLM's
Qwen3-VL hands them to its decoder).

The patch embedding, a Conv3d whose kernel equals its stride, is a linear map over the
flattened patch; attention, its 2-D rotary and the MLPs are transformers'
(`modeling_qwen2_vl.py`: PatchEmbed, Qwen2VLVisionRotaryEmbedding, VisionAttention,
Qwen2VLVisionBlock, PatchMerger; `modeling_qwen2_5_vl.py`: RMSNorm and a gated MLP in
the blocks, an RMSNorm before the merger, windows from get_vision_window_index;
`modeling_qwen3_vl.py`: a biased patch embedding plus pos_embed resampled by
get_vision_interpolation_indices_and_weights, LayerNorm blocks with linear_fc1/fc2 MLPs,
Qwen3VLVisionPatchMerger and its post-shuffle-norm DeepStack twins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from neuron_plugin.backends.reference.architectures import UnsupportedModelError
from neuron_plugin.backends.reference.decoder import owned, rms_norm
from neuron_plugin.backends.reference.llama4_vision import (
    Llama4VisionGraph,
    Llama4VisionSpec,
    is_llama4_vision,
)
from neuron_plugin.backends.reference.llama4_vision import weight_names as llama4_weight_names
from neuron_plugin.backends.reference.mlp import activation
from neuron_plugin.backends.reference.patch_attention import patch_attention
from neuron_plugin.backends.reference.patch_layout import patch_inputs, position_taps
from neuron_plugin.backends.reference.pixtral import PixtralGraph, PixtralSpec, is_pixtral
from neuron_plugin.backends.reference.pixtral import weight_names as pixtral_weight_names
from neuron_plugin.core.checkpoint import canonical_tensor_name, safetensors_files
from neuron_plugin.core.vision import VisionGeometry

PREFIX = "visual."
NORM_EPS = 1e-6  # transformers' vision blocks and merger
MLP_QWEN2 = ("mlp.fc1", "mlp.fc2")
MLP_QWEN2_5 = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MLP_QWEN3 = ("mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower's facts, from config.json's vision_config."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_hidden: int
    out_hidden: int  # the text decoder's hidden size
    activation: str
    patch_dim: int  # the processor's values per patch (core.vision.VisionGeometry)
    spatial_merge_size: int
    rope_theta: float
    # Qwen2.5-VL: RMSNorms and gated MLPs, attention within windows of this many merge
    # groups a side except in the full-attention blocks; 0: Qwen2-VL (every block full)
    window: int = 0
    full_blocks: tuple[int, ...] = ()
    # Qwen3-VL: a learned position grid of this many rows a side (0: none, the Qwen2-VL
    # family) and the blocks whose output a DeepStack merger also takes
    position_side: int = 0
    deepstack: tuple[int, ...] = ()

    @property
    def qwen2_5(self) -> bool:
        return self.window > 0

    @property
    def qwen3(self) -> bool:
        return self.position_side > 0

    @property
    def embedding_width(self) -> int:
        """Values the graph answers per merged group: the embedding and its DeepStack
        features (core.vision.VisionGeometry.embedding_width)."""
        return self.out_hidden * (1 + len(self.deepstack))

    def image_inputs(self, grid_thw: np.ndarray, patches: int) -> list[np.ndarray]:
        """What the graph takes of an image's grid, padded to `patches`: rotary_ids and
        groups (`patch_inputs`), and Qwen3-VL's position taps (`position_taps`)."""
        arrays = list(patch_inputs(grid_thw, self.spatial_merge_size, patches, self.window))
        if self.qwen3:
            arrays += position_taps(grid_thw, self.spatial_merge_size, self.position_side, patches)
        return arrays

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def merge_patches(self) -> int:
        return self.spatial_merge_size**2

    @classmethod
    def from_hf_config(cls, config: dict) -> VisionSpec:
        geometry = VisionGeometry.from_hf_config(config)
        if geometry is None:
            raise UnsupportedModelError(
                f"architectures={config.get('architectures')}: config.json has no "
                f"vision_config, which a vision-language model needs"
            )
        vision: dict[str, Any] = config["vision_config"]
        params = vision.get("rope_parameters") or {}
        common: dict[str, Any] = {
            "depth": int(vision["depth"]),
            "num_heads": int(vision["num_heads"]),
            "patch_dim": geometry.patch_dim,
            "spatial_merge_size": geometry.spatial_merge_size,
            "rope_theta": float(params.get("rope_theta", 10000.0)),
        }
        architectures = config.get("architectures") or []
        if "Qwen3VLForConditionalGeneration" in architectures:
            return cls(
                **common,
                embed_dim=int(vision["hidden_size"]),
                mlp_hidden=int(vision["intermediate_size"]),
                out_hidden=int(vision["out_hidden_size"]),
                activation=vision.get("hidden_act", "gelu_pytorch_tanh"),
                position_side=int(int(vision.get("num_position_embeddings", 2304)) ** 0.5),
                deepstack=tuple(int(i) for i in vision.get("deepstack_visual_indexes", ())),
            )
        if "Qwen2_5_VLForConditionalGeneration" in architectures:
            patch, merge = int(vision.get("patch_size", 14)), geometry.spatial_merge_size
            return cls(
                **common,
                embed_dim=int(vision["hidden_size"]),
                mlp_hidden=int(vision["intermediate_size"]),
                out_hidden=int(vision["out_hidden_size"]),
                activation=vision.get("hidden_act", "silu"),
                # transformers' vit_merger_window_size
                window=int(vision.get("window_size", 112)) // merge // patch,
                full_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())),
            )
        embed_dim = int(vision["embed_dim"])
        return cls(
            **common,
            embed_dim=embed_dim,
            mlp_hidden=int(embed_dim * vision.get("mlp_ratio", 4)),
            out_hidden=int(vision["hidden_size"]),
            activation=vision.get("hidden_act", "quick_gelu"),
        )


Tower = VisionSpec | PixtralSpec | Llama4VisionSpec


def vision_tower(config: dict[str, Any]) -> Tower:
    """The spec of the config's vision tower: Pixtral's (Llava format), Llama 4's
    (`llama4_vision`) or the Qwen2-VL family's and Qwen3-VL's."""
    if is_pixtral(config):
        return PixtralSpec.from_hf_config(config)
    if is_llama4_vision(config):
        return Llama4VisionSpec.from_hf_config(config)
    if "LlavaForConditionalGeneration" in (config.get("architectures") or []):
        kind = (config.get("vision_config") or {}).get("model_type")
        raise UnsupportedModelError(
            f"LlavaForConditionalGeneration with a {kind!r} vision tower: the reference "
            f"backend runs Llava with Pixtral's (vision_config model_type 'pixtral') only"
        )
    return VisionSpec.from_hf_config(config)


def vision_graph(spec: Tower) -> VisionGraph | PixtralGraph | Llama4VisionGraph:
    if isinstance(spec, PixtralSpec):
        return PixtralGraph(spec)
    if isinstance(spec, Llama4VisionSpec):
        return Llama4VisionGraph(spec)
    return VisionGraph(spec)


def weight_names(spec: Tower) -> list[str]:
    """The vision graph's weight inputs, in order (the checkpoint's names; Qwen3-VL's
    as core.checkpoint.canonical_tensor_name reads them)."""
    if isinstance(spec, PixtralSpec):
        return pixtral_weight_names(spec)
    if isinstance(spec, Llama4VisionSpec):
        return llama4_weight_names(spec)
    norm_bias = () if spec.qwen2_5 else (".bias",)  # RMSNorm or LayerNorm
    mlp = MLP_QWEN3 if spec.qwen3 else MLP_QWEN2_5 if spec.qwen2_5 else MLP_QWEN2
    names = [PREFIX + "patch_embed.proj.weight"]
    if spec.qwen3:
        names += [PREFIX + "patch_embed.proj.bias", PREFIX + "pos_embed.weight"]
    for i in range(spec.depth):
        p = f"{PREFIX}blocks.{i}."
        for norm, linears in (("norm1", ("attn.qkv", "attn.proj")), ("norm2", mlp)):
            names += [f"{p}{norm}{x}" for x in (".weight", *norm_bias)]
            for module in linears:
                names += [f"{p}{module}.weight", f"{p}{module}.bias"]
    mergers = [f"{PREFIX}merger."]
    if spec.qwen3:
        mergers += [f"{PREFIX}deepstack_merger_list.{j}." for j in range(len(spec.deepstack))]
    for m in mergers:
        norm, linears = _merger_modules(spec)
        names += [f"{m}{norm}{x}" for x in (".weight", *norm_bias)]
        for module in linears:
            names += [f"{m}{module}.weight", f"{m}{module}.bias"]
    return names


def _merger_modules(spec: VisionSpec) -> tuple[str, tuple[str, str]]:
    """A patch merger's norm and its two linears."""
    if spec.qwen3:
        return "norm", ("linear_fc1", "linear_fc2")
    return "ln_q", ("mlp.0", "mlp.2")


def load_weights(model_dir: str | Path, spec: Tower, dtype: torch.dtype) -> list[torch.Tensor]:
    """The vision tower's tensors of the checkpoint, in `weight_names` order."""
    from safetensors import safe_open

    wanted = set(weight_names(spec))
    found: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is no dict)
                name = canonical_tensor_name(stored)
                if name in wanted:
                    found[name] = f.get_tensor(stored)
    return [owned(found[name], dtype) for name in checked_names(spec, found)]


def weight_shapes(spec: Tower, shapes: Mapping[str, list[int]]) -> list[list[int]]:
    """The vision graph's weight shapes from the checkpoint's (safetensors headers)."""
    return [list(shapes[name]) for name in checked_names(spec, shapes)]


def checked_names(spec: Tower, present: Mapping[str, object]) -> list[str]:
    names = weight_names(spec)
    missing = [n for n in names if n not in present]
    if missing:
        raise UnsupportedModelError(
            f"the checkpoint lacks {len(missing)} tensors of the vision tower, e.g. {missing[:3]}"
        )
    return names


class VisionGraph(nn.Module):
    """The vision tower over one bucket of patches (see the module docstring)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.names = weight_names(spec)
        # transformers' axial rotary: head_dim / 4 frequencies each for row and column
        quarter = spec.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float) / quarter
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (spec.rope_theta**exponents), persistent=True)

    def forward(
        self,
        weights: list[torch.Tensor],
        pixel_values: torch.Tensor,
        rotary_ids: torch.Tensor,
        groups: torch.Tensor,
        taps: torch.Tensor | None = None,
        tap_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        s = self.spec
        w = dict(zip(self.names, weights, strict=True))
        patch_weight = w[PREFIX + "patch_embed.proj.weight"]
        dtype = patch_weight.dtype
        x = pixel_values.to(dtype) @ patch_weight.reshape(s.embed_dim, -1).t()
        if s.qwen3:
            assert taps is not None and tap_weights is not None, "Qwen3-VL needs position taps"
            x = x + w[PREFIX + "patch_embed.proj.bias"]
            blended = (w[PREFIX + "pos_embed.weight"][taps] * tap_weights.unsqueeze(-1)).sum(1)
            x = x + blended.to(dtype)

        freqs = rotary_ids.unsqueeze(-1).float() * self.inv_freq  # [n, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # rows' then columns' frequencies
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)  # [n, 1, head_dim]
        # [2, n, n]: same frame, same window; never padding
        visible = (groups.unsqueeze(2) == groups.unsqueeze(1)) & (groups >= 0).unsqueeze(1)

        deepstack = []
        for i in range(s.depth):
            p = f"{PREFIX}blocks.{i}."
            windowed = s.qwen2_5 and i not in s.full_blocks
            h = self._norm(w, p + "norm1", x)
            x = x + self._attention(w, p + "attn.", h, cos, sin, visible[int(windowed)])
            x = x + self._mlp(w, p, self._norm(w, p + "norm2", x))
            if i in s.deepstack:
                level = s.deepstack.index(i)
                merger = f"{PREFIX}deepstack_merger_list.{level}."
                deepstack.append(self._merge(w, merger, x, postshuffle=True))
        return torch.cat([self._merge(w, PREFIX + "merger.", x), *deepstack], dim=-1)

    def _merge(
        self, w: dict[str, torch.Tensor], m: str, x: torch.Tensor, postshuffle: bool = False
    ) -> torch.Tensor:
        """A patch merger: each merge group's patches normed (per patch, or Qwen3-VL's
        DeepStack mergers after the shuffle into one row), two linears around a GELU."""
        s = self.spec
        norm, (fc1, fc2) = _merger_modules(s)
        grouped = s.embed_dim * s.merge_patches
        if postshuffle:
            h = self._norm(w, m + norm, x.reshape(-1, grouped))
        else:
            h = self._norm(w, m + norm, x).reshape(-1, grouped)
        h = functional.gelu(self._linear(w, m + fc1, h))
        return self._linear(w, m + fc2, h)

    def _mlp(self, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if not s.qwen2_5:
            fc1, fc2 = (p + m for m in (MLP_QWEN3 if s.qwen3 else MLP_QWEN2))
            return self._linear(w, fc2, activation(s.activation, self._linear(w, fc1, x)))
        gate, up, down = (p + m for m in MLP_QWEN2_5)
        gated = activation(s.activation, self._linear(w, gate, x)) * self._linear(w, up, x)
        return self._linear(w, down, gated)

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
        q, k, v = self._linear(w, p + "qkv", x).reshape(n, 3, s.num_heads, s.head_dim).unbind(1)
        out = patch_attention(q, k, v, cos, sin, visible, rotary_dtype=torch.float32)
        return self._linear(w, p + "proj", out)

    @staticmethod
    def _linear(w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, w[module + ".weight"], w[module + ".bias"])

    def _norm(self, w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL's and Qwen3-VL's LayerNorm, Qwen2.5-VL's RMSNorm."""
        weight = w[module + ".weight"]
        if self.spec.qwen2_5:
            return rms_norm("rms", x, weight, NORM_EPS)
        return functional.layer_norm(x, weight.shape, weight, w[module + ".bias"], NORM_EPS)
