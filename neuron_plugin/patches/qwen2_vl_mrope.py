"""Patch `qwen2-vl-mrope`: NxDI's Qwen2-VL text model cannot rotate by M-RoPE positions.

Qwen2-VL rotates each head's three sections (time, height, width: `mrope_section`) by
three position rows, which differ for image tokens (transformers' get_rope_index; the
plugin's core.vision.mrope_positions). NxDI's text model
(qwen2_vl/modeling_qwen2_vl_text.py, the same in 0.8 cd3abf3 and 0.9 ef2731e) has two
gaps, measured on both releases (image prompts differ from transformers; fed 3-D
positions through a changed rotary forward, they are equal):

- `NeuronQwen2VLRotaryEmbedding.forward(x, position_ids)` indexes `position_ids[None,
  :, None, :]`: 2-D positions [B, S] become three identical sections, and 3-D
  positions [3, B, S] come out in a wrong shape;
- `Qwen2VLTextModelWrapper` inherits ImageToTextModelWrapper.input_generator, which
  traces `rotary_position_ids` (input 21) as an empty tensor, so no compiled graph
  takes them (Qwen3-VL's own wrapper traces them [3, batch, width] int32).

The fix: the rotary forward takes 3-D positions (section i's angles from row i, the
shipped code for 2-D ones), and the wrapper traces input 21 as int32 zeros [3, batch,
width] for every bucket. The backend then passes M-RoPE positions on every call
(backends/nxd/vision_arguments.py reads whether the example takes them). Traced: both
change the text graphs, whose input shapes gain the rotary positions.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from neuron_plugin.patches.base import NxDIModules, Patch, is_patched, replace_method

NAME = "qwen2-vl-mrope"
ARCHITECTURES = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})
EMBEDDING = "NeuronQwen2VLRotaryEmbedding"
ROTARY = 21  # rotary_position_ids in an image-to-text wrapper's inputs
_PROBE_DIM = 8  # head dim of the probe's stand-in embedding


def _sections_rotated_apart(module: ModuleType) -> bool:
    """Whether the rotary forward gives each of three different position rows its own
    angles, [3, B, S, head_dim] (the shipped one gives another shape)."""
    config = SimpleNamespace(hidden_size=_PROBE_DIM, num_attention_heads=1, rope_theta=10000.0)
    embedding = getattr(module, EMBEDDING)(config)
    positions = torch.arange(12).reshape(3, 1, 4)
    cos, _ = embedding(torch.zeros(1, dtype=torch.float32), positions)
    return tuple(cos.shape) == (3, 1, 4, _PROBE_DIM) and not torch.equal(cos[0], cos[1])


def _traces_rotary(module: ModuleType) -> bool:
    """Whether the text wrapper defines its own input_generator (the inherited one traces
    rotary_position_ids empty); the plugin's replacement counts."""
    wrapper = module.Qwen2VLTextModelWrapper
    return "input_generator" in vars(wrapper) or is_patched(wrapper.input_generator, NAME)


def _text_module(modules: NxDIModules) -> ModuleType | None:
    """NxDI's Qwen2-VL text model among the release's image-to-text ones."""
    return next((m for m in modules.vision_text if hasattr(m, EMBEDDING)), None)


def probe(modules: NxDIModules) -> str | None:
    module = _text_module(modules)
    if module is None:
        return None
    found = []
    if not _sections_rotated_apart(module):
        found.append("NeuronQwen2VLRotaryEmbedding.forward broadcasts positions to all three")
    if not _traces_rotary(module):
        found.append("Qwen2VLTextModelWrapper traces rotary_position_ids empty")
    return "; ".join(found) + " (image tokens lose M-RoPE)" if found else None


def _mrope_forward(shipped: Callable) -> Callable:
    def forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        if position_ids.dim() != 3:
            return shipped(self, x, position_ids)
        # [3, B, S, 1] x [dim / 2] -> [3, B, S, dim / 2], each section's own positions
        angles = position_ids.float().unsqueeze(-1) * self.inv_freq.float()
        both = torch.cat((angles, angles), dim=-1)
        scale = self.attention_scaling
        return (both.cos() * scale).to(x.dtype), (both.sin() * scale).to(x.dtype)

    return forward


def _with_rotary_example(shipped: Callable) -> Callable:
    def input_generator(self: Any) -> list[tuple[torch.Tensor, ...]]:
        examples = []
        for example in shipped(self):
            batch, width = example[0].shape
            rotary = torch.zeros((3, batch, width), dtype=torch.int32)
            examples.append((*example[:ROTARY], rotary, *example[ROTARY + 1 :]))
        return examples

    return input_generator


def apply(modules: NxDIModules) -> bool:
    module = _text_module(modules)
    if module is None:
        return False
    changed = False
    if not _sections_rotated_apart(module):
        changed |= replace_method(getattr(module, EMBEDDING), "forward", NAME, _mrope_forward)
    if not _traces_rotary(module):
        wrapper = module.Qwen2VLTextModelWrapper
        changed |= replace_method(wrapper, "input_generator", NAME, _with_rotary_example)
    return changed


PATCH = Patch(
    name=NAME,
    defect="Qwen2-VL's text model takes no M-RoPE positions (image tokens rotated in 1-D)",
    probe=probe,
    apply=apply,
    architectures=ARCHITECTURES,
)
