"""The Qwen2-VL family's vision towers as one fixed-shape function of (weights, patches),
one graph per vision bucket (core.vision).

An image arrives as its processor's flattened patches (channels x temporal x patch x
patch values each), already in merge-block order: every spatial_merge_size**2
consecutive patches form one merged embedding. What depends on the image's grid is
computed on the host (`patch_inputs`, numpy) and enters the graph as inputs, so one graph
serves every grid of at most its bucket's patches:
  pixel_values: [patches, patch_dim]   the image's patches, zero rows after the real ones
  rotary_ids:   [patches, 2]           each patch's (row, column) in the grid
  groups:       [2, patches]           each patch's attention group: its frame (full
                                       attention) and its window (Qwen2.5-VL's windowed
                                       blocks; the frame again for Qwen2-VL); -1: padding
A patch attends to the patches of its group (transformers' cu_seqlens /
cu_window_seqlens) and never to padding; the padded rows compute garbage that
`LoadedBackend.encode_image` drops. Qwen2.5-VL reorders patches window by window before
its blocks and back after its merger (whole merge groups both times): attention within a
group and the merger are indifferent to that order, so the graph keeps the processor's.
The graph answers [patches / merge**2, text hidden] embeddings (PatchMerger).

The patch embedding, a Conv3d whose kernel equals its stride, is a linear map over the
flattened patch; attention, its 2-D rotary and the MLPs are transformers'
(`modeling_qwen2_vl.py`: PatchEmbed, Qwen2VLVisionRotaryEmbedding, VisionAttention,
Qwen2VLVisionBlock, PatchMerger; `modeling_qwen2_5_vl.py`: RMSNorm and a gated MLP in
the blocks, an RMSNorm before the merger, windows from get_vision_window_index).
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
from neuron_plugin.backends.reference.decoder import rms_norm, rotate_half
from neuron_plugin.backends.reference.mlp import activation
from neuron_plugin.backends.reference.pixtral import PixtralGraph, PixtralSpec, is_pixtral
from neuron_plugin.backends.reference.pixtral import weight_names as pixtral_weight_names
from neuron_plugin.core.checkpoint import safetensors_files
from neuron_plugin.core.vision import VisionGeometry

PREFIX = "visual."
NORM_EPS = 1e-6  # transformers' vision blocks and merger
MLP_QWEN2 = ("mlp.fc1", "mlp.fc2")
MLP_QWEN2_5 = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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

    @property
    def qwen2_5(self) -> bool:
        return self.window > 0

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
        if "Qwen2_5_VLForConditionalGeneration" in (config.get("architectures") or []):
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


def vision_tower(config: dict[str, Any]) -> VisionSpec | PixtralSpec:
    """The spec of the config's vision tower: Pixtral's (Llava format) or the Qwen2-VL
    family's."""
    if is_pixtral(config):
        return PixtralSpec.from_hf_config(config)
    if "LlavaForConditionalGeneration" in (config.get("architectures") or []):
        kind = (config.get("vision_config") or {}).get("model_type")
        raise UnsupportedModelError(
            f"LlavaForConditionalGeneration with a {kind!r} vision tower: the reference "
            f"backend runs Llava with Pixtral's (vision_config model_type 'pixtral') only"
        )
    return VisionSpec.from_hf_config(config)


def vision_graph(spec: VisionSpec | PixtralSpec) -> VisionGraph | PixtralGraph:
    return PixtralGraph(spec) if isinstance(spec, PixtralSpec) else VisionGraph(spec)


def weight_names(spec: VisionSpec | PixtralSpec) -> list[str]:
    """The vision graph's weight inputs, in order (the checkpoint's names)."""
    if isinstance(spec, PixtralSpec):
        return pixtral_weight_names(spec)
    norm_bias = () if spec.qwen2_5 else (".bias",)  # RMSNorm or LayerNorm
    mlp = MLP_QWEN2_5 if spec.qwen2_5 else MLP_QWEN2
    names = [PREFIX + "patch_embed.proj.weight"]
    for i in range(spec.depth):
        p = f"{PREFIX}blocks.{i}."
        for norm, linears in (("norm1", ("attn.qkv", "attn.proj")), ("norm2", mlp)):
            names += [f"{p}{norm}{x}" for x in (".weight", *norm_bias)]
            for module in linears:
                names += [f"{p}{module}.weight", f"{p}{module}.bias"]
    names += [f"{PREFIX}merger.ln_q{x}" for x in (".weight", *norm_bias)]
    for module in ("mlp.0", "mlp.2"):
        names += [f"{PREFIX}merger.{module}.weight", f"{PREFIX}merger.{module}.bias"]
    return names


def patch_inputs(
    grid_thw: np.ndarray, merge: int, patches: int, window: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(rotary_ids [patches, 2], groups [2, patches]) of an image of `grid_thw` padded to
    `patches`: each patch's (row, column) in merge-block order, as transformers'
    get_vision_position_ids lays them out, its frame and its window of `window` merge
    groups a side (get_vision_window_index's; 0: its frame), -1 for padding."""
    t, h, w = (int(n) for n in grid_thw)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
    real = t * h * w
    rotary_ids = np.zeros((patches, 2), dtype=np.int64)
    rotary_ids[:real] = np.tile(np.stack([rows, cols], axis=-1), (t, 1))
    groups = np.full((2, patches), -1, dtype=np.int64)
    frames = np.repeat(np.arange(t), h * w)
    groups[0, :real] = frames
    if window:  # the window of each patch's merge group, numbered within the image
        across = -(-(w // merge) // window)  # windows a row
        down = -(-(h // merge) // window)
        row, col = rows // merge // window, cols // merge // window
        groups[1, :real] = (frames * down + np.tile(row, t)) * across + np.tile(col, t)
    else:
        groups[1, :real] = frames
    return rotary_ids, groups


def load_weights(
    model_dir: str | Path, spec: VisionSpec | PixtralSpec, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The vision tower's tensors of the checkpoint, in `weight_names` order."""
    from safetensors import safe_open

    wanted = set(weight_names(spec))
    found: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in wanted.intersection(f.keys()):
                found[name] = f.get_tensor(name)
    return [found[name].to(dtype).contiguous() for name in checked_names(spec, found)]


def weight_shapes(
    spec: VisionSpec | PixtralSpec, shapes: Mapping[str, list[int]]
) -> list[list[int]]:
    """The vision graph's weight shapes from the checkpoint's (safetensors headers)."""
    return [list(shapes[name]) for name in checked_names(spec, shapes)]


def checked_names(spec: VisionSpec | PixtralSpec, present: Mapping[str, object]) -> list[str]:
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
    ) -> torch.Tensor:
        s = self.spec
        w = dict(zip(self.names, weights, strict=True))
        patch_weight = w[PREFIX + "patch_embed.proj.weight"]
        dtype = patch_weight.dtype
        x = pixel_values.to(dtype) @ patch_weight.reshape(s.embed_dim, -1).t()

        freqs = rotary_ids.unsqueeze(-1).float() * self.inv_freq  # [n, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # rows' then columns' frequencies
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)  # [n, 1, head_dim]
        # [2, n, n]: same frame, same window; never padding
        visible = (groups.unsqueeze(2) == groups.unsqueeze(1)) & (groups >= 0).unsqueeze(1)

        for i in range(s.depth):
            p = f"{PREFIX}blocks.{i}."
            windowed = s.qwen2_5 and i not in s.full_blocks
            h = self._norm(w, p + "norm1", x)
            x = x + self._attention(w, p + "attn.", h, cos, sin, visible[int(windowed)])
            x = x + self._mlp(w, p, self._norm(w, p + "norm2", x))

        m = PREFIX + "merger."
        h = self._norm(w, m + "ln_q", x).reshape(-1, s.embed_dim * s.merge_patches)
        h = functional.gelu(self._linear(w, m + "mlp.0", h))
        return self._linear(w, m + "mlp.2", h)

    def _mlp(self, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if not s.qwen2_5:
            fc1, fc2 = (p + m for m in MLP_QWEN2)
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
        # the rotary in float32, as transformers' apply_rotary_pos_emb_vision
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        scores = (q.transpose(0, 1) @ k.permute(1, 2, 0)) * s.head_dim**-0.5  # [heads, n, n]
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = (probs @ v.transpose(0, 1)).transpose(0, 1).reshape(n, s.embed_dim)
        return self._linear(w, p + "proj", out)

    @staticmethod
    def _linear(w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, w[module + ".weight"], w[module + ".bias"])

    def _norm(self, w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL's LayerNorm, Qwen2.5-VL's RMSNorm."""
        weight = w[module + ".weight"]
        if self.spec.qwen2_5:
            return rms_norm("rms", x, weight, NORM_EPS)
        return functional.layer_norm(x, weight.shape, weight, w[module + ".bias"], NORM_EPS)
