"""Qwen2-VL as a class of the plugin's own on NxD Inference: NxDI's image-to-text
application for Qwen2-VL (qwen2_vl/modeling_qwen2_vl.py NeuronQwen2VLForCausalLM: its
text model, weights converter and text wrappers, with patches qwen2-vl-mrope and
vision-scatter-scratch-row) around a vision encoder that takes any image grid.

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
"""

from __future__ import annotations

from typing import Any

import torch
from neuronx_distributed_inference.models.model_wrapper import EncoderModelInstance, ModelWrapper
from neuronx_distributed_inference.models.qwen2_vl import modeling_qwen2_vl
from neuronx_distributed_inference.models.qwen2_vl.modeling_qwen2_vl_vision import (
    NeuronQwen2VisionModel,
)
from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

# NxDI's Qwen2VLInferenceConfig.add_special_config copies this key from the config's top
# level (QWEN2_VL_TEXT_CONFIG_KEYS); transformers' Qwen2-VL config has none and no NxDI
# code reads it.
_UNREAD_KEYS = {"vision_token_id": None}
FULL_ATTENTION = 0  # the row of `groups` that full-attention blocks use


class NeuronQwen2VLAnyGridVision(NeuronQwen2VisionModel):
    """NxDI's Qwen2-VL vision modules driven by host-computed, grid-independent inputs
    (the module docstring)."""

    def forward(
        self, pixel_values: torch.Tensor, rotary_ids: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.patch_embed(pixel_values).unsqueeze(0)  # [1, P, D]
        # transformers' VisionRotaryEmbedding frequencies: rows', then columns' angles
        angles = rotary_ids.float().unsqueeze(-1) * self.rotary_pos_emb.inv_freq.float()
        angles = angles.flatten(1)
        both = torch.cat((angles, angles), dim=-1).unsqueeze(0)  # [1, P, head_dim]
        position = (both.cos(), both.sin())
        frame = groups[FULL_ATTENTION]
        visible = (frame.unsqueeze(1) == frame.unsqueeze(0)) & (frame >= 0).unsqueeze(0)
        for block in self.blocks:
            attended = block.attn(
                block.norm1(hidden), position_embeddings=position, attention_mask=visible
            )[0]
            hidden = hidden + attended
            hidden = hidden + block.mlp(block.norm2(hidden))
        return self.merger(hidden[0])


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

    vision_model_cls = NeuronQwen2VLAnyGridVision
    vision_model_wrapper = AnyGridVisionWrapper

    @classmethod
    def get_config_cls(cls) -> type:
        return AnyGridQwen2VLConfig

    @staticmethod
    def config_loader(model_path: str) -> Any:
        """NxDI's load_config on the checkpoint's config with its text keys also at the
        top level: Qwen2VLInferenceConfig.add_special_config reads the text model's keys
        only there, where transformers 5 saves no longer put them."""
        from transformers import AutoConfig, PretrainedConfig

        config = AutoConfig.from_pretrained(model_path).to_dict()
        flat = {**_UNREAD_KEYS, **config.get("text_config", {}), **config}
        return load_pretrained_config(hf_config=PretrainedConfig(**flat))
