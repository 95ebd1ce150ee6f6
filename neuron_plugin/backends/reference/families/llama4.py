"""Llama 4 (Llama4ForConditionalGeneration): its text decoder's facts and its vision
tower.

The text decoder (`ARCHITECTURES`, `llama4_fields`): NoPE layers (config no_rope_layers
0) with attention temperature tuning, the RoPE layers' RoPE on interleaved pairs
(transformers' apply_rotary_emb, complex numbers), their keys within attention_chunk_size
chunks and, with use_qk_norm, q and k L2-normed after RoPE; dense and MoE layers (a
shared expert beside a top-1 sigmoid router, `mlp`), the MLP in feed_forward.

The vision tower and multi-modal projector as one fixed-shape function of (weights,
patches), one graph per vision bucket: the same call as the other towers' graphs
(`reference.vision`), so the backend runs each alike.

Llama 4's processor cuts an image into tiles of vision_config.image_size pixels a side
(the local tiles row by row, then, for an image of more than one, the global tile: the
whole image scaled to one tile), and the tower runs each tile on its own: a tile is a
batch row, its patches attend to each other and its class token only, and its rotary
angles and learned positions are the same for every tile. So a vision bucket is a
number of patches that holds whole tiles (core.vision.tile_patches lays an image's
tiles out, (tiles, side, side) patches), the graph needs no per-image layout inputs, and
a padding tile (zero pixels) is a batch row of its own that no real tile sees.

Per tile, as transformers' `modeling_llama4.py` computes it: the Unfold patch embedding
(a linear map over each patch's channels x patch x patch values, no bias), the class
embedding appended after the patches, positional_embedding_vlm added, layernorm_pre;
the encoder layers (LayerNorm, attention with biased projections and the 2-D rotary of
Llama4VisionRotaryEmbedding: complex pairs of q and k turned by (column + 1) and
(row + 1) times the frequencies, the class token unturned; LayerNorm, fc1, exact GELU,
fc2); layernorm_post; the class token dropped; Llama4VisionPixelShuffleMLP
(pixel_shuffle of the patch grid, fc1, GELU, fc2, GELU, no biases) and the projector's
linear_1 (no bias): patches x pixel_shuffle_ratio**2 embeddings of the text hidden size,
in the order vLLM's Llama 4 hands them to the <|patch|> placeholders (mllama4.py
_process_image_input: an image's tiles in the processor's order, flattened).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from neuron_plugin.backends.reference.architecture import (
    CHUNKED,
    FULL,
    Architecture,
    UnsupportedModelError,
)
from neuron_plugin.core.vision import VisionGeometry

TOWER = "vision_model."
PROJECTOR = "multi_modal_projector."
NORM_EPS = 1e-5  # transformers' nn.LayerNorm default: Llama 4's tower ignores norm_eps
VISION_MODEL_TYPE = "llama4_vision_model"


def llama4_fields(arch: Architecture, config: dict, layers: int) -> dict[str, Any]:
    """Llama 4's per-layer RoPE, chunks, qk-norm and temperature tuning, as
    transformers' Llama4TextConfig derives them (no_rope_layers from
    no_rope_layer_interval where absent or empty; layer_types from no_rope_layers)."""
    interval = int(config.get("no_rope_layer_interval", 4))
    no_rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    rope_layers = tuple(bool(no_rope[i]) for i in range(layers))
    types = config.get("layer_types") or [CHUNKED if r else FULL for r in rope_layers]
    chunk = config.get("attention_chunk_size")
    if chunk is not None:
        chunk = int(chunk)
    elif CHUNKED in types[:layers]:
        raise UnsupportedModelError(
            f"{arch.family}: layer_types has {CHUNKED!r} layers but attention_chunk_size is "
            f"unset (transformers refuses it too); set attention_chunk_size in config.json"
        )
    tuning = None
    if config.get("attn_temperature_tuning", True):
        tuning = (float(config.get("floor_scale", 8192)), float(config.get("attn_scale", 0.1)))
    return {
        "rope_layers": rope_layers,
        "chunks": tuple(chunk if t == CHUNKED else None for t in types[:layers]),
        "l2_qk_norm": bool(config.get("use_qk_norm", True)),
        "temperature_tuning": tuning,
    }


ARCHITECTURES = {
    "Llama4ForConditionalGeneration": Architecture(
        "llama4",
        attention_bias="none",
        windowed=False,
        mlp="llama4",
        default_rope_theta=500_000.0,
        llama4=True,
        mlp_module="feed_forward",
        vision=True,
        mrope=False,
        spec_fields=llama4_fields,
    )
}


def tower(config: dict[str, Any]) -> Llama4VisionSpec:
    vision = config.get("vision_config")
    kind = vision.get("model_type") if isinstance(vision, dict) else None
    if kind != VISION_MODEL_TYPE:
        raise UnsupportedModelError(
            f"Llama4ForConditionalGeneration with a {kind!r} vision tower: the reference "
            f"backend runs Llama 4's own ({VISION_MODEL_TYPE!r})"
        )
    return Llama4VisionSpec.from_hf_config(config)


@dataclass(frozen=True)
class Llama4VisionSpec:
    """The tower's and projector's facts, from config.json."""

    depth: int
    embed_dim: int
    num_heads: int
    side: int  # patches a tile side: image_size // patch_size
    patch_dim: int  # channels x patch x patch (core.vision.VisionGeometry)
    spatial_merge_size: int  # 1 / pixel_shuffle_ratio: a tile's embeddings are side / it a side
    rope_theta: float
    embedding_width: int  # the text decoder's hidden size
    window: int = 0  # what the backend shares with the Qwen2-VL family's VisionSpec

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def tile_patches(self) -> int:
        return self.side * self.side

    @property
    def merge_patches(self) -> int:
        """The patches a vision bucket holds a multiple of: whole tiles."""
        return self.tile_patches

    def image_inputs(self, grid_thw: np.ndarray, patches: int) -> list[np.ndarray]:
        """None: every tile's layout is the same. An image's grid is checked to be whole
        tiles of this tower's (a padding call's grid is zero)."""
        tiles, height, width = (int(n) for n in grid_thw)
        if tiles and (height, width) != (self.side, self.side):
            raise ValueError(
                f"image grid_thw={[tiles, height, width]}: Llama 4's tower takes tiles of "
                f"{self.side}x{self.side} patches (the model's processor cuts them so)"
            )
        return []

    def graph(self) -> Llama4VisionGraph:
        return Llama4VisionGraph(self)

    def weight_names(self) -> list[str]:
        return weight_names(self)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Llama4VisionSpec:
        """transformers runs the last layer's features whatever
        vision_feature_select_strategy and vision_feature_layer say (both unread)."""
        geometry = VisionGeometry.from_hf_config(config)
        assert geometry is not None  # `tower`: a vision_config
        vision: dict[str, Any] = config["vision_config"]
        params = vision.get("rope_parameters") or {}
        side = int(vision["image_size"]) // int(vision["patch_size"])
        return cls(
            depth=int(vision["num_hidden_layers"]),
            embed_dim=int(vision["hidden_size"]),
            num_heads=int(vision["num_attention_heads"]),
            side=side,
            patch_dim=geometry.patch_dim,
            spatial_merge_size=geometry.spatial_merge_size,
            rope_theta=float(params.get("rope_theta", vision.get("rope_theta", 10000.0))),
            embedding_width=geometry.hidden_size,
        )


def weight_names(spec: Llama4VisionSpec) -> list[str]:
    """The graph's weight inputs, in order (the checkpoint's names)."""
    names = [
        TOWER + "patch_embedding.linear.weight",
        TOWER + "class_embedding",
        TOWER + "positional_embedding_vlm",
        TOWER + "layernorm_pre.weight",
        TOWER + "layernorm_pre.bias",
    ]
    for i in range(spec.depth):
        p = f"{TOWER}model.layers.{i}."
        for module in (
            "input_layernorm",
            *(f"self_attn.{x}_proj" for x in "qkvo"),
            "post_attention_layernorm",
            "mlp.fc1",
            "mlp.fc2",
        ):
            names += [f"{p}{module}.weight", f"{p}{module}.bias"]
    names += [TOWER + "layernorm_post.weight", TOWER + "layernorm_post.bias"]
    names += [TOWER + "vision_adapter.mlp.fc1.weight", TOWER + "vision_adapter.mlp.fc2.weight"]
    return [*names, PROJECTOR + "linear_1.weight"]


def rotary_angles(spec: Llama4VisionSpec) -> torch.Tensor:
    """[tile patches + 1, head_dim / 2] float32: each complex pair's angle per token of a
    tile (the class token last, at angle 0), as Llama4VisionRotaryEmbedding builds
    freqs_ci: the first half of the pairs turn by (column + 1), the second by (row + 1),
    times the same head_dim / 4 frequencies."""
    quarter = spec.head_dim // 4
    half = spec.head_dim // 2
    frequencies = 1.0 / (spec.rope_theta ** (torch.arange(0, half, 2)[:quarter].float() / half))
    index = torch.arange(spec.tile_patches, dtype=torch.int32)
    columns, rows = index % spec.side, index // spec.side
    angles = torch.cat(
        [(columns + 1)[:, None] * frequencies, (rows + 1)[:, None] * frequencies], dim=-1
    )
    return torch.cat([angles.float(), torch.zeros(1, half)])


class Llama4VisionGraph(nn.Module):
    """Llama 4's tower and projector over one bucket of patches (module docstring)."""

    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.spec = spec
        self.names = weight_names(spec)
        angles = rotary_angles(spec)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos(), persistent=True)
        self.register_buffer("sin", angles.sin(), persistent=True)

    def forward(self, weights: list[torch.Tensor], pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [bucket, patch_dim] (whole tiles) -> [bucket x ratio**2, hidden]."""
        s = self.spec
        w = dict(zip(self.names, weights, strict=True))
        patch_weight = w[TOWER + "patch_embedding.linear.weight"]
        dtype = patch_weight.dtype
        tiles = pixel_values.shape[0] // s.tile_patches
        x = pixel_values.to(dtype).reshape(tiles, s.tile_patches, -1) @ patch_weight.t()
        cls = w[TOWER + "class_embedding"].expand(tiles, 1, s.embed_dim)
        x = torch.cat([x, cls], dim=1) + w[TOWER + "positional_embedding_vlm"]
        x = self._norm(w, TOWER + "layernorm_pre", x)
        for i in range(s.depth):
            p = f"{TOWER}model.layers.{i}."
            x = x + self._attention(w, p + "self_attn.", self._norm(w, p + "input_layernorm", x))
            h = self._norm(w, p + "post_attention_layernorm", x)
            h = functional.gelu(self._linear(w, p + "mlp.fc1", h))
            x = x + self._linear(w, p + "mlp.fc2", h)
        x = self._norm(w, TOWER + "layernorm_post", x)[:, :-1]
        x = pixel_shuffle(x, s.side, s.spatial_merge_size)
        adapter = TOWER + "vision_adapter.mlp."
        x = functional.gelu(x @ w[adapter + "fc1.weight"].t())
        x = functional.gelu(x @ w[adapter + "fc2.weight"].t())
        return (x @ w[PROJECTOR + "linear_1.weight"].t()).reshape(-1, s.embedding_width)

    def _attention(self, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        tiles, tokens, _ = x.shape
        q, k, v = (
            self._linear(w, f"{p}{name}_proj", x).reshape(tiles, tokens, s.num_heads, s.head_dim)
            for name in "qkv"
        )
        q, k = self._rotated(q), self._rotated(k)
        scores = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) * s.head_dim**-0.5
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = (probs @ v.transpose(1, 2)).transpose(1, 2).reshape(tiles, tokens, s.embed_dim)
        return self._linear(w, p + "o_proj", out)

    def _rotated(self, t: torch.Tensor) -> torch.Tensor:
        """vision_apply_rotary_emb: (even, odd) pairs as complex numbers, times
        exp(i angle), in float32."""
        pairs = t.float().reshape(*t.shape[:-1], -1, 2)
        real, imaginary = pairs[..., 0], pairs[..., 1]
        cos, sin = self.cos[:, None], self.sin[:, None]  # [tokens, 1, head_dim / 2]
        turned = torch.stack([real * cos - imaginary * sin, real * sin + imaginary * cos], -1)
        return turned.flatten(-2).to(t.dtype)

    @staticmethod
    def _linear(w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, w[module + ".weight"], w[module + ".bias"])

    @staticmethod
    def _norm(w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        weight = w[module + ".weight"]
        return functional.layer_norm(x, weight.shape, weight, w[module + ".bias"], NORM_EPS)


def pixel_shuffle(x: torch.Tensor, side: int, merge: int) -> torch.Tensor:
    """transformers' pixel_shuffle at ratio 1 / merge: [tiles, side * side, channels] ->
    [tiles, (side / merge)**2, channels * merge**2], its reshapes and transposes in its
    order (the channel order of each embedding's patches matters to fc1)."""
    tiles, _, channels = x.shape
    x = x.reshape(tiles, side, side // merge, channels * merge).transpose(1, 2)
    x = x.reshape(tiles, side // merge, side // merge, channels * merge * merge).transpose(1, 2)
    return x.reshape(tiles, -1, channels * merge * merge)
