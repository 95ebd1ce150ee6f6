"""Patch `adapter-forward-kwargs`: the HF adapter builds model inputs that the model's
forward() cannot take.

NxDI 0.7, 0.8 and 0.9 as released (Neuron SDK 2.27, 2.28, 2.29; utils/hf_adapter.py):
`HuggingFaceGenerationAdapter.prepare_inputs_for_generation` puts `tensor_capture_hook`
into the model inputs, reading it as a global the module never defines (NameError), and
`NeuronBaseForCausalLM.forward()` (models/model_base.py) has no such parameter either;
the SDK 2.27 wheel measured in the field defines it and fails in forward() with
"forward() got an unexpected keyword argument 'tensor_capture_hook'". Fixed only by the
release-2.29-v2 sync (ef2731e, still 0.9.0): the adapter reads the hook from its kwargs
and forward() takes it. The fix defines the missing global as None and filters the
inputs against the signature of the forward() actually called; the probe reads the
code, not the version, so the ef2731e build is left alone.
"""

from __future__ import annotations

import builtins
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from neuron_plugin import plugin_logger
from neuron_plugin.patches.base import NxDIModules, Patch, code_mentions, replace_method, unpatched

logger = plugin_logger(__name__)

NAME = "adapter-forward-kwargs"
HOOK = "tensor_capture_hook"


def accepted_inputs(forward: Callable, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """`inputs` without the keys `forward` has no parameter for (all of them when it
    takes **kwargs). Dropping a value that is set is logged: it changes behaviour."""
    params = inspect.signature(forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(inputs)
    dropped = [k for k, v in inputs.items() if k not in params and v is not None]
    if dropped:
        logger.warning(
            "NxDI patch %s: this NxDI's forward() takes no %s; the values given are ignored",
            NAME,
            ", ".join(dropped),
        )
    return {k: v for k, v in inputs.items() if k in params}


def _missing_global(modules: NxDIModules) -> bool:
    prepare = unpatched(
        modules.hf_adapter.HuggingFaceGenerationAdapter.prepare_inputs_for_generation
    )
    return (
        HOOK in prepare.__code__.co_names
        and not hasattr(modules.hf_adapter, HOOK)
        and not hasattr(builtins, HOOK)
    )


def probe(modules: NxDIModules) -> str | None:
    forward = modules.model_base.NeuronBaseForCausalLM.forward
    params = inspect.signature(forward).parameters
    takes_hook = HOOK in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    prepare = unpatched(
        modules.hf_adapter.HuggingFaceGenerationAdapter.prepare_inputs_for_generation
    )
    if _missing_global(modules):
        return f"prepare_inputs_for_generation reads {HOOK} as an undefined global (NameError)"
    if takes_hook or not code_mentions(prepare.__code__, HOOK):
        return None
    return (
        f"prepare_inputs_for_generation passes {HOOK} but "
        f"NeuronBaseForCausalLM.forward() has no such parameter (TypeError)"
    )


def apply(modules: NxDIModules) -> bool:
    if _missing_global(modules):
        setattr(modules.hf_adapter, HOOK, None)

    def make(original: Callable) -> Callable:
        def prepare_inputs_for_generation(self, *args, **kwargs):
            inputs = original(self, *args, **kwargs)
            return accepted_inputs(self.neuron_model.forward, inputs)

        return prepare_inputs_for_generation

    return replace_method(
        modules.hf_adapter.HuggingFaceGenerationAdapter, "prepare_inputs_for_generation", NAME, make
    )


PATCH = Patch(
    name=NAME,
    defect="HF adapter passes inputs (tensor_capture_hook) the model's forward() rejects",
    probe=probe,
    apply=apply,
)
