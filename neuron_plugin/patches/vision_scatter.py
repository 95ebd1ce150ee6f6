"""Patch `vision-scatter-scratch-row`: a prompt that fills its context bucket loses its
last token's embedding.

NxDI's image-to-text text models merge image embeddings into the token embeddings with
`scatter_by_index_put(target [1, L, H], rows, positions [1, L, 1])`
(models/llama4/utils/encoder_utils.py lines 248-281, the same in 0.8 cd3abf3 and 0.9
ef2731e): row i of `rows` goes to position `positions[i]`, for every entry of
`positions`. Positions past the image's are padding, and NxDI pads them with L - 1
(encoder_utils.pad_positions, the image-to-text wrappers' dummy inputs and
ModelWrapper.pad_inputs), so they write a zero (or unused) row to position L - 1: the
last real token when the prompt is exactly L long. Qwen3-VL's DeepStack adds
(`deepstack_process_xla`) go through the same function. No position inside [0, L) is
free to take the padding, so the fix scatters into the target with one scratch row
appended and drops that row: the plugin pads positions with L (backends/nxd
/vision_arguments.py), and NxDI's own L - 1 padding behaves as before. The replacement
is the module global each text model looks up (Qwen3-VL:
qwen3_vl/modeling_qwen3_vl_text.py, Qwen2-VL and Qwen2.5-VL:
qwen2_vl/modeling_qwen2_vl_text.py, Pixtral: pixtral/modeling_pixtral.py, Llama 4:
llama4/modeling_llama4_text.py, each `from ...encoder_utils import
scatter_by_index_put`), so it is traced into the context-encoding graphs; their input
shapes do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from neuron_plugin.patches.base import NxDIModules, Patch, replace_method, unpatched

NAME = "vision-scatter-scratch-row"
FUNCTION = "scatter_by_index_put"
ARCHITECTURES = frozenset(
    {
        "Qwen3VLForConditionalGeneration",
        "LlavaForConditionalGeneration",
        "Llama4ForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
    }
)


def _text_modules(modules: NxDIModules) -> list[ModuleType]:
    return [m for m in modules.vision_text if hasattr(m, FUNCTION)]


def _writes_past_the_target(scatter: Callable) -> bool:
    """Whether `scatter` accepts a position equal to the target's length (the scratch
    row): NxDI's index_put_ raises IndexError there."""
    target = torch.zeros(1, 2, 1)
    try:
        scatter(target, torch.ones(1, 1), torch.tensor([[[2]]]))
    except (IndexError, RuntimeError):
        return False
    return True


def probe(modules: NxDIModules) -> str | None:
    found = [
        m
        for m in _text_modules(modules)
        if not _writes_past_the_target(unpatched(getattr(m, FUNCTION)))
    ]
    if not found:
        return None
    names = ", ".join(m.__name__.rsplit(".", 1)[-1] for m in found)
    return (
        f"{FUNCTION} in {names} has no row for padding positions (they overwrite "
        f"position L-1, a full bucket's last token)"
    )


def with_scratch_row(shipped: Callable) -> Callable:
    """`shipped` run on the target with one zero row appended, that row dropped after."""

    def scatter(target: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, length, width = target.shape
        scratch = torch.cat([target, target.new_zeros(batch, 1, width)], dim=1)
        return shipped(scratch, rows, positions)[:, :length]

    return scatter


def apply(modules: NxDIModules) -> bool:
    changed = False
    for module in _text_modules(modules):
        if _writes_past_the_target(unpatched(getattr(module, FUNCTION))):
            continue
        changed |= replace_method(module, FUNCTION, NAME, with_scratch_row)
    return changed


PATCH = Patch(
    name=NAME,
    defect="image padding positions overwrite the last token of a full context bucket",
    probe=probe,
    apply=apply,
    architectures=ARCHITECTURES,
)
