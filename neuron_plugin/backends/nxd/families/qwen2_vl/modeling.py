"""Qwen2-VL and Qwen2.5-VL as classes of the plugin's own on NxD Inference: NxDI's
image-to-text application for Qwen2-VL (qwen2_vl/modeling_qwen2_vl.py
NeuronQwen2VLForCausalLM: its text model, which both share, weights converter and text
wrappers, with patches qwen2-vl-mrope and vision-scatter-scratch-row) around a vision
encoder that takes any image grid.

NxDI's own vision encoder (qwen2_vl/modeling_qwen2_vl_vision.py, 0.8 cd3abf3 and 0.9
ef2731e) cannot serve vLLM's images: its buckets are images of one configured size
(Qwen2VLVisionModelWrapper), its rotary positions come from a Python loop over the grid
values, so a traced graph keeps the trace-time grid (NeuronQwen2VisionModel.rot_pos_ids),
and its attention has no mask, so padding and a second image would be attended to. The
encoder here keeps NxDI's modules and weights (the patch embedding, each block's
LayerNorms, attention on NeuronAttentionBase and MLP on NxD's parallel layers, the
merger) and changes what the graph takes: one graph per plugin vision bucket (patches
per image), with the grid-dependent arrays computed on the host
(backends/nxd/qwen2_vl_vision.py, the reference backend's patch_layout):

    pixel_values [P, C*T*p*p]  the image's patches, zero rows after them
    rotary_ids   [P, 2] int32  each patch's (row, column), merge-block order
    groups       [2, P] int32  each patch's frame (full attention) and window; -1: pad

A patch attends to the patches of its frame only, never to padding (transformers'
cu_seqlens). The answer is [P / merge**2, text hidden]; the host keeps the image's rows.

Qwen2.5-VL's tower, which no NxDI release has, is built here from the same parts where
they are the same (transformers' modeling_qwen2_5_vl.py: the patch embedding, the 2-D
rotary, the attention with biased qkv and output, a merger of two linears around a
GELU) and its own where they differ: RMSNorm instead of LayerNorm in the blocks and the
merger, a gated MLP with biases (NxD's parallel layers), and window attention: blocks
outside `fullatt_block_indexes` attend within windows of `window_size` pixels a side
(the second row of `groups`; transformers' get_window_index reorders patches window by
window, which neither attention within a group nor the merger's whole merge groups see,
so the graph keeps the processor's order). NxDI's converter and attention read the
Qwen2-VL names, so the checkpoint's Qwen2.5-VL vision keys are given them on loading
(`config_loader`): `embed_dim` the tower's width, `hidden_size` the text one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from neuronx_distributed_inference.models.model_wrapper import EncoderModelInstance, ModelWrapper
from neuronx_distributed_inference.models.qwen2_vl import modeling_qwen2_vl
from neuronx_distributed_inference.models.qwen2_vl.modeling_qwen2_vl_vision import (
    NeuronQwen2VisionModel,
    NeuronQwen2VLAttention,
    PatchEmbed,  # transformers' (4.57), as NxDI's tower imports it
    PatchMerger,
    VisionRotaryEmbedding,  # likewise
)
from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config
from torch import nn
from transformers.activations import ACT2FN

from neuron_plugin.backends.nxd.own_classes.parallel_mlp import GatedMLP

# NxDI's Qwen2VLInferenceConfig.add_special_config copies this key from the config's top
# level (QWEN2_VL_TEXT_CONFIG_KEYS); transformers' Qwen2-VL config has none and no NxDI
# code reads it.
_UNREAD_KEYS = {"vision_token_id": None}
NORM_EPS = 1e-6  # the towers' norms (transformers' Qwen2-VL and Qwen2.5-VL vision)


def run_tower(
    tower: Any,
    pixel_values: torch.Tensor,
    rotary_ids: torch.Tensor,
    groups: torch.Tensor,
    windowed: Collection[int] = (),
) -> torch.Tensor:
    """A tower's graph (the module docstring): the blocks in `windowed` attend within the
    second row of `groups` (windows), the others within the first (frames)."""
    hidden = tower.patch_embed(pixel_values).unsqueeze(0)  # [1, P, D]
    # transformers' VisionRotaryEmbedding frequencies: rows', then columns' angles
    angles = rotary_ids.float().unsqueeze(-1) * tower.rotary_pos_emb.inv_freq.float()
    angles = angles.flatten(1)
    both = torch.cat((angles, angles), dim=-1).unsqueeze(0)  # [1, P, head_dim]
    position = (both.cos(), both.sin())
    # [2, P, P]: same frame, same window; never padding
    visible = (groups.unsqueeze(2) == groups.unsqueeze(1)) & (groups >= 0).unsqueeze(1)
    for index, block in enumerate(tower.blocks):
        mask = visible[int(index in windowed)]
        attended = block.attn(
            block.norm1(hidden), position_embeddings=position, attention_mask=mask
        )[0]
        hidden = hidden + attended
        hidden = hidden + block.mlp(block.norm2(hidden))
    return tower.merger(hidden[0])


class NeuronQwen2VLAnyGridVision(NeuronQwen2VisionModel):
    """NxDI's Qwen2-VL vision modules driven by host-computed, grid-independent inputs
    (the module docstring)."""

    def forward(
        self, pixel_values: torch.Tensor, rotary_ids: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        return run_tower(self, pixel_values, rotary_ids, groups)


class RMSNorm(nn.Module):
    """transformers' Qwen2RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return self.weight * normed.to(x.dtype)


class Qwen25VisionBlock(nn.Module):
    """A Qwen2.5-VL vision block: RMSNorms, NxDI's Qwen2-VL vision attention, a gated MLP
    with biases."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        dtype = vision.neuron_config.torch_dtype
        self.norm1 = RMSNorm(vision.embed_dim, dtype)
        self.norm2 = RMSNorm(vision.embed_dim, dtype)
        self.attn = NeuronQwen2VLAttention(vision)
        act = ACT2FN[vision.hidden_act]
        self.mlp = GatedMLP(vision, vision.embed_dim, vision.intermediate_size, act, bias=True)


class NeuronQwen25VLAnyGridVision(nn.Module):
    """Qwen2.5-VL's vision tower on NxDI's and NxD's parallel modules (the module
    docstring), driven as the Qwen2-VL one."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        dtype = vision.neuron_config.torch_dtype
        self.patch_embed = PatchEmbed(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            in_channels=vision.in_channels,
            embed_dim=vision.embed_dim,
        ).to(dtype)
        self.rotary_pos_emb = VisionRotaryEmbedding(vision.head_dim // 2)
        self.blocks = nn.ModuleList([Qwen25VisionBlock(vision) for _ in range(vision.depth)])
        self.merger = PatchMerger(
            dim=vision.hidden_size,
            context_dim=vision.embed_dim,
            spatial_merge_size=vision.spatial_merge_size,
            dtype=dtype,
        )
        self.merger.ln_q = RMSNorm(vision.embed_dim, dtype)
        full = set(vision.fullatt_block_indexes)
        self.windowed = frozenset(i for i in range(vision.depth) if i not in full)

    def forward(
        self, pixel_values: torch.Tensor, rotary_ids: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        return run_tower(self, pixel_values, rotary_ids, groups, self.windowed)


class AnyGridVisionWrapper(ModelWrapper):
    """The vision encoder's wrapper: one traced example per plugin vision bucket (the
    vision NeuronConfig's buckets are patches per image), run by the backend with inputs
    already padded to their bucket (`_forward`)."""

    def input_generator(self) -> list[tuple[torch.Tensor, ...]]:
        vision = self.config.vision_config
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        dtype = vision.neuron_config.torch_dtype
        return [
            (
                torch.zeros((patches, width), dtype=dtype),
                torch.zeros((patches, 2), dtype=torch.int32),
                torch.full((2, patches), -1, dtype=torch.int32),
            )
            for patches in vision.neuron_config.buckets
        ]

    def get_model_instance(self) -> Any:
        return EncoderModelInstance(model_cls=self.model_cls, config=self.config)

    def forward(self, *args: torch.Tensor) -> Any:
        return self._forward(*args)


class AnyGridQwen2VLConfig(modeling_qwen2_vl.Qwen2VLInferenceConfig):
    """NxDI's Qwen2-VL config, whose check that `vision buckets x patches of the default
    image / 4` fit the longest text bucket (validate_model_supported_configs) reads
    vision buckets as images per call: here they are patches per image, and the backend
    checks their tokens fit (image_to_text.check_vision_fits). Everything else is
    checked as NxDI does."""

    def validate_model_supported_configs(self) -> None:
        vision = self.vision_config.neuron_config
        buckets, vision.buckets = vision.buckets, None  # NxDI skips the check without any
        try:
            super().validate_model_supported_configs()
        finally:
            vision.buckets = buckets


class NeuronQwen2VLForImageToText(modeling_qwen2_vl.NeuronQwen2VLForCausalLM):
    """NxDI's Qwen2-VL application with the any-grid vision encoder (module docstring)."""

    vision_model_cls: type[nn.Module] = NeuronQwen2VLAnyGridVision
    vision_model_wrapper = AnyGridVisionWrapper

    @classmethod
    def get_config_cls(cls) -> type:
        return AnyGridQwen2VLConfig

    @classmethod
    def config_loader(cls, model_path: str) -> Any:
        """NxDI's load_config on the checkpoint's config with its text keys also at the
        top level: Qwen2VLInferenceConfig.add_special_config reads the text model's keys
        only there, where transformers 5 saves no longer put them."""
        from transformers import AutoConfig, PretrainedConfig

        config = AutoConfig.from_pretrained(model_path).to_dict()
        config["vision_config"] = cls.vision_keys(config["vision_config"])
        flat = {**_UNREAD_KEYS, **config.get("text_config", {}), **config}
        return load_pretrained_config(hf_config=PretrainedConfig(**flat))

    @staticmethod
    def vision_keys(vision: dict[str, Any]) -> dict[str, Any]:
        """The vision config in the names NxDI's Qwen2-VL reads (Qwen2-VL's own)."""
        return vision


class NeuronQwen25VLForImageToText(NeuronQwen2VLForImageToText):
    """NxDI's Qwen2-VL application with the Qwen2.5-VL tower (module docstring)."""

    vision_model_cls = NeuronQwen25VLAnyGridVision

    @staticmethod
    def vision_keys(vision: dict[str, Any]) -> dict[str, Any]:
        """Qwen2.5-VL's vision keys in Qwen2-VL's names: its `hidden_size` is the tower's
        width (Qwen2-VL's `embed_dim`), its `out_hidden_size` the text model's (Qwen2-VL's
        `hidden_size`, the merger's output); `mlp_ratio`, which Qwen2VLInferenceConfig
        requires, from `intermediate_size` (the gated MLP reads that)."""
        width = int(vision["hidden_size"])
        return {
            **vision,
            "embed_dim": width,
            "hidden_size": int(vision["out_hidden_size"]),
            "mlp_ratio": int(vision["intermediate_size"]) / width,
        }
