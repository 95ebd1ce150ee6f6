"""Patch `cpu-captured-offset`: NxDI 0.7's and 0.8's own CPU mode cannot run a causal LM.

On the CPU (`on_cpu`, `NeuronApplicationBase.to_cpu()`) every forward of
`NeuronBaseForCausalLM` copies the KV cache out of the outputs
(`_copy_past_key_values`, called when the generation model `is_neuron()` is False: 0.8
cd3abf3 model_base.py lines 3481-3482), and that method asks
`self._get_captured_tensors_offset()` where the cache starts among them (0.8 lines 3827,
3831; 0.7 v0.7.14366 lines 4011, 4015). NxDI 0.7 and 0.8 define that method only on
`NeuronBaseForImageToText` (image_to_text_model_base.py, 0.8 line 631), so every CPU
forward of a text model raises AttributeError. NxDI 0.9 adds it to
`NeuronBaseForCausalLM` (ef2731e model_base.py lines 3816-3819: the tensor-capture
offset, 0 without tensor capture). The fix adds the same method where the copy calls it
and the class lacks it. A device never
takes that path, so no compiled graph changes (`traced=False`: not in the cache key).
"""

from __future__ import annotations

from typing import Any

from neuron_plugin.patches.base import MARKER, NxDIModules, Patch, code_mentions

NAME = "cpu-captured-offset"
METHOD = "_get_captured_tensors_offset"


def captured_tensors_offset(self: Any) -> int:
    """How many captured tensors precede the KV cache among a graph's outputs: the
    tensor-capture configuration's offset, 0 without one (as NxDI 0.9 counts it)."""
    capture = self.neuron_config.tensor_capture_config
    return int(capture.get_offset()) if capture else 0


def probe(modules: NxDIModules) -> str | None:
    cls = modules.model_base.NeuronBaseForCausalLM
    copy = getattr(cls, "_copy_past_key_values", None)
    if copy is None or not code_mentions(copy.__code__, METHOD):
        return None
    current = getattr(cls, METHOD, None)
    if current is not None and getattr(current, MARKER, None) is None:
        return None  # the release defines it
    return (
        f"NeuronBaseForCausalLM._copy_past_key_values calls {METHOD}, which the class "
        f"does not define (every forward in NxDI's CPU mode raises AttributeError)"
    )


def apply(modules: NxDIModules) -> bool:
    cls = modules.model_base.NeuronBaseForCausalLM
    if getattr(getattr(cls, METHOD, None), MARKER, None) is not None:
        return False

    def _get_captured_tensors_offset(self: Any) -> int:
        return captured_tensors_offset(self)

    setattr(_get_captured_tensors_offset, MARKER, (NAME, None))
    setattr(cls, METHOD, _get_captured_tensors_offset)
    return True


PATCH = Patch(
    name=NAME,
    defect="NxDI's CPU mode calls a method a text model lacks",
    probe=probe,
    apply=apply,
    traced=False,
)
