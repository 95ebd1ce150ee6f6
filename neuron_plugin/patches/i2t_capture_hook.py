"""Patch `i2t-capture-hook`: NxDI 0.8's image-to-text forward reads a name it never
defines.

`NeuronBaseForImageToText.forward` (0.8 cd3abf3 models/image_to_text_model_base.py lines
517-629) takes no `tensor_capture_hook` parameter, yet its last lines (625) test
`tensor_capture_hook`, which is no global of that module either: every call that gets
that far raises NameError, on a device as on the CPU. NxDI 0.9 (ef2731e line 539) makes
it a parameter. The fix defines the module global as None (no hook: what 0.9's default
gives), so the test is false. Host Python only: no compiled graph changes.
"""

from __future__ import annotations

from neuron_plugin.patches.base import MARKER, NxDIModules, Patch

NAME = "i2t-capture-hook"
GLOBAL = "tensor_capture_hook"
_APPLIED = f"{MARKER}{NAME}"  # set on the module once this patch defined the global


def probe(modules: NxDIModules) -> str | None:
    module = modules.image_to_text_model_base
    if module is None:
        return None
    forward = module.NeuronBaseForImageToText.forward
    if GLOBAL not in forward.__code__.co_names:  # a parameter (0.9) or not used
        return None
    if hasattr(module, GLOBAL) and not getattr(module, _APPLIED, False):
        return None  # the release defines the global itself
    return (
        f"NeuronBaseForImageToText.forward reads the global {GLOBAL}, which "
        f"image_to_text_model_base does not define (NameError on every call)"
    )


def apply(modules: NxDIModules) -> bool:
    module = modules.image_to_text_model_base
    if module is None or getattr(module, _APPLIED, False):
        return False
    setattr(module, GLOBAL, None)
    setattr(module, _APPLIED, True)
    return True


PATCH = Patch(
    name=NAME,
    defect="NxDI 0.8's image-to-text forward reads an undefined tensor_capture_hook",
    probe=probe,
    apply=apply,
    traced=False,
)
