"""The one place that imports NxD Inference: the parts of it the backend calls, imported
when a backend is built (so explain-config, doctor and tests run without NxDI) and
patched where the installed release has a known defect."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

from neuron_plugin.backends.nxd.lora import NxDILora
from neuron_plugin.backends.nxd.models import NxDIModelClass
from neuron_plugin.core.instances import package_version
from neuron_plugin.core.settings import NeuronConfigError
from neuron_plugin.patches import PATCHES, NxDIModules, apply_patches


@dataclass(frozen=True)
class NxDI:
    """The parts of NxD Inference this backend calls."""

    model_types: Mapping[str, Mapping[str, NxDIModelClass]]
    load_pretrained_config: Callable
    prepare_sampling_params: Callable
    # models/config.py FusedSpecNeuronConfig(worker_cls, draft_config, draft_model_path,
    # draft_model_cls): a fused draft model's part of the InferenceConfig.
    fused_spec_config: Callable
    version: str | None
    # The patches in effect: they change what NxDI traces, so they are in the cache key.
    patches: tuple[str, ...]
    # What its LoRA serving (modules/lora_serving) can do.
    lora: NxDILora
    # Each patch's outcome (patches.PatchOutcome.status) by name.
    patch_status: Mapping[str, str]
    # models/layer_boundary_marker.py: NxD's module markers (the CPU mode's identity).
    layer_boundary_marker: ModuleType
    # models/model_base.py: the helpers its forward uses (mask_padded_logits,
    # get_tp_group, _gather_along_dim), for the prompt-logprob submodel's.
    model_base: ModuleType
    # models/image_to_text_model_base.py: NeuronBaseForImageToText, the application of
    # the vision-language models (backends/nxd/image_to_text.py); None where not shipped.
    image_to_text_model_base: ModuleType | None

    def patches_for(self, architecture: str) -> tuple[str, ...]:
        """The patches in effect that change `architecture`'s graphs (the cache key's)."""
        changing = {p.name for p in PATCHES if p.changes(architecture)}
        return tuple(name for name in self.patches if name in changing)


def import_nxdi() -> NxDI:
    """Import NxD Inference and apply the patches its installed version needs."""
    try:
        import neuronx_distributed_inference as package
        from neuronx_distributed_inference.models import (
            layer_boundary_marker,
            model_base,
            model_wrapper,
        )
        from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig
        from neuronx_distributed_inference.modules.attention import attention_base
        from neuronx_distributed_inference.modules.generation import sampling
        from neuronx_distributed_inference.modules.lora_serving import (
            LoraModelManager,
            LoraServingConfig,
        )
        from neuronx_distributed_inference.utils import hf_adapter
        from neuronx_distributed_inference.utils.constants import MODEL_TYPES
    except ImportError as exc:
        raise NeuronConfigError(
            f"VLLM_NEURON_BACKEND=nxd needs NxD Inference, which cannot be imported by "
            f"{sys.executable} ({exc}). NxDI pins torch 2.9 and transformers 4.5x, which "
            f"current vLLM cannot share an environment with: point "
            f"VLLM_NEURON_BACKEND_PYTHON at the Neuron SDK's interpreter (e.g. "
            f"/opt/aws_neuronx_venv_pytorch_2_9/bin/python) so the backend runs there as a "
            f"runner process (docs/serving/inf2.md; check with `neuron-plugin "
            f"doctor`), or set VLLM_NEURON_BACKEND=reference."
        ) from exc
    outcomes = apply_patches(
        NxDIModules(
            model_base,
            model_wrapper,
            hf_adapter,
            attention_base,
            sampling,
            _gemma3_module(),
            _image_to_text_module(),
            _vision_text_modules(),
        )
    )
    patched = tuple(o.name for o in outcomes if o.status in ("applied", "already applied"))
    return NxDI(
        MODEL_TYPES,
        hf_adapter.load_pretrained_config,
        sampling.prepare_sampling_params,
        FusedSpecNeuronConfig,
        # the distribution's version carries a source build's commit; the package's own
        # __version__ (_version.py) is there without installed metadata
        package_version("neuronx-distributed-inference") or package.__version__,
        patched,
        NxDILora.probe(LoraServingConfig, LoraModelManager),
        {o.name: o.status for o in outcomes},
        layer_boundary_marker,
        model_base,
        _image_to_text_module(),
    )


def _gemma3_module() -> ModuleType | None:
    """NxDI's Gemma3 modelling (models/gemma3/modeling_gemma3.py) where the release ships
    it, None otherwise: 0.7 has none; 0.8 ships it without listing it in MODEL_TYPES
    (the architecture table names the module there, `models.table` NxDIModule), 0.9
    lists it. Its patches probe and fix whichever release's module is installed."""
    try:
        from neuronx_distributed_inference.models.gemma3 import modeling_gemma3
    except ImportError:
        return None
    return modeling_gemma3


def _image_to_text_module() -> ModuleType | None:
    """NxDI's image-to-text application base (models/image_to_text_model_base.py), None
    where the installed NxDI has none (then no architecture is served as one)."""
    try:
        from neuronx_distributed_inference.models import image_to_text_model_base
    except ImportError:
        return None
    return image_to_text_model_base


# NxDI's image-to-text text models (under neuronx_distributed_inference.models), each
# shipped from 0.8: the vision-scatter patch replaces the merge function they look up,
# qwen2-vl-mrope Qwen2-VL's rotary embedding and text wrapper, llama4-rope-temperature
# Llama 4's rotary embedding.
VISION_TEXT_MODULES = (
    "qwen3_vl.modeling_qwen3_vl_text",
    "qwen2_vl.modeling_qwen2_vl_text",
    "pixtral.modeling_pixtral",
    "llama4.modeling_llama4_text",
)


def _vision_text_modules() -> tuple[ModuleType, ...]:
    """The VISION_TEXT_MODULES the installed release ships."""
    found = []
    for name in VISION_TEXT_MODULES:
        try:
            found.append(importlib.import_module(f"neuronx_distributed_inference.models.{name}"))
        except ImportError:
            continue
    return tuple(found)
