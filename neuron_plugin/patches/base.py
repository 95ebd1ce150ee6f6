"""What every patch shares: the NxDI modules it works on, its record, and the marked
method replacement that makes applying twice a no-op."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

MARKER = "__neuron_plugin_patch__"


@dataclass(frozen=True)
class NxDIModules:
    """The NxDI modules the patches touch (imported by `backends.nxd`)."""

    model_base: ModuleType  # neuronx_distributed_inference.models.model_base
    model_wrapper: ModuleType  # neuronx_distributed_inference.models.model_wrapper
    hf_adapter: ModuleType  # neuronx_distributed_inference.utils.hf_adapter
    attention_base: ModuleType  # neuronx_distributed_inference.modules.attention.attention_base
    sampling: ModuleType  # neuronx_distributed_inference.modules.generation.sampling
    # neuronx_distributed_inference.models.gemma3.modeling_gemma3 (None before NxDI 0.9)
    gemma3: ModuleType | None = None
    # neuronx_distributed_inference.models.image_to_text_model_base (None: not shipped)
    image_to_text_model_base: ModuleType | None = None
    # The image-to-text text models the release ships (backends.nxd.nxdi
    # VISION_TEXT_MODULES), whose merge function (and Qwen2-VL's and Llama 4's
    # rotary embeddings) the patches replace
    vision_text: tuple[ModuleType, ...] = ()


@dataclass(frozen=True)
class Patch:
    """One defect: `probe` returns evidence that it is present (None: absent), `apply`
    fixes it and returns False when it was already fixed by this plugin."""

    name: str
    defect: str
    probe: Callable[[NxDIModules], str | None]
    apply: Callable[[NxDIModules], bool]
    # The architectures whose graphs it changes (empty: every one's), for the cache key.
    architectures: frozenset[str] = frozenset()
    # False: it changes code only NxDI's CPU mode runs, so no compiled graph.
    traced: bool = True

    def changes(self, architecture: str) -> bool:
        return self.traced and (not self.architectures or architecture in self.architectures)


def unpatched(function: Callable) -> Callable:
    """The function as NxDI defined it, under any wrappers of this package (each marked
    with (patch name, the function it wraps) by `replace_method`)."""
    while (mark := getattr(function, MARKER, None)) is not None:
        function = mark[1]
    return function


def is_patched(function: Callable, name: str) -> bool:
    while (mark := getattr(function, MARKER, None)) is not None:
        if mark[0] == name:
            return True
        function = mark[1]
    return False


def replace_method(
    cls: type | ModuleType, attribute: str, name: str, make: Callable[[Callable], Callable]
) -> bool:
    """Set `cls.attribute = make(current)`, marked with `name`; False (and no change)
    when a wrapper with that name is already in place. `cls` may be a module (a
    module-level function its code looks up at call time)."""
    current = getattr(cls, attribute)
    if is_patched(current, name):
        return False
    wrapper = functools.wraps(current)(make(current))
    setattr(wrapper, MARKER, (name, current))
    setattr(cls, attribute, wrapper)
    return True


def code_mentions(code: CodeType, word: str) -> bool:
    """Whether compiled code uses `word` as a name or a constant (dict keys of a
    literal are a constant tuple), looking into nested functions too."""
    if word in code.co_names:
        return True
    stack: list[Any] = list(code.co_consts)
    while stack:
        const = stack.pop()
        if const == word:
            return True
        if isinstance(const, tuple):
            stack.extend(const)
        elif isinstance(const, CodeType):
            if word in const.co_names:
                return True
            stack.extend(const.co_consts)
    return False
