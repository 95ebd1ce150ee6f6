"""Which NxD Inference class serves a checkpoint: a built-in table over NxDI's
`MODEL_TYPES`, plus the entry-point group `neuron_plugin.nxdi_models` where NxDI contrib
models register a class under a Hugging Face architecture name (a registered entry point
wins, so a contrib model can replace a built-in one)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from neuron_plugin import plugin_logger
from neuron_plugin.core.settings import NeuronConfigError

logger = plugin_logger(__name__)


class NxDIModelClass(Protocol):
    """What the backend calls on an NxDI application class (NeuronBaseForCausalLM)."""

    __module__: str
    __qualname__: str

    def get_neuron_config_cls(self) -> Callable[..., Any]: ...

    def get_config_cls(self) -> Callable[..., Any]: ...

    def save_quantized_state_dict(self, model_path: str, config: Any) -> None: ...

    def __call__(self, model_path: str, config: Any) -> Any: ...


ENTRY_POINT_GROUP = "neuron_plugin.nxdi_models"
TASK = "causal-lm"
# Hugging Face architecture -> key of NxDI's utils.constants.MODEL_TYPES (text models);
# what each serves, per feature, is in `compat`.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DbrxForCausalLM": "dbrx",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3",
}
# Vision-language architectures -> their NxDI MODEL_TYPES key (utils/constants.py, 0.9):
# each but mllama pairs the causal-lm application with an "image-encoding" one, which
# the backend does not drive yet. NxDI 0.9's Qwen2-VL text model also rotates every
# M-RoPE axis by the same 1-D position (modeling_qwen2_vl_text.py
# NeuronQwen2VLRotaryEmbedding.forward expands position_ids to 3 equal rows), where
# transformers gives image tokens their (t, h, w) positions (get_rope_index).
VISION_LANGUAGE = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "LlavaForConditionalGeneration": "pixtral",
    "Llama4ForConditionalGeneration": "llama4",
    "MllamaForConditionalGeneration": "mllama",
}
# MODEL_TYPES keys that are not in every release, -> the first release listing them
# (utils/constants.py): 0.8 (cd3abf3) ships models/gemma3 but registers neither.
LISTED_FROM = {"mistral": "0.9.0 (ef2731e, the SDK 2.29 v2 sync)", "gemma3": "0.9"}


def model_entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def describe_architecture(
    architecture: str, entry_points: Iterable[importlib.metadata.EntryPoint]
) -> str:
    """Which NxDI class would serve `architecture`, without importing NxDI."""
    refuse_vision_language(architecture)
    for ep in entry_points:
        if ep.name == architecture:
            return f"{ep.value} (entry point {ENTRY_POINT_GROUP}:{ep.name})"
    if architecture in ARCHITECTURES:
        return f"NxDI MODEL_TYPES[{ARCHITECTURES[architecture]!r}][{TASK!r}]"
    raise NeuronConfigError(_unsupported(architecture))


def refuse_vision_language(architecture: str) -> None:
    """A vision-language model is refused by name (see VISION_LANGUAGE)."""
    if architecture in VISION_LANGUAGE:
        key = VISION_LANGUAGE[architecture]
        raise NeuronConfigError(
            f"architecture {architecture!r} is a vision-language model: NxD Inference "
            f"serves it as MODEL_TYPES[{key!r}]'s image-encoding and causal-lm "
            f"applications, and the nxd backend does not drive NxDI's image encoding "
            f"yet; serve it on the CPU with VLLM_NEURON_BACKEND=reference."
        )


def _unsupported(architecture: str) -> str:
    return (
        f"architecture {architecture!r} has no NxD Inference model: supported are "
        f"{', '.join(ARCHITECTURES)}; an NxDI contrib model can register its class "
        f"under this name in the {ENTRY_POINT_GROUP!r} entry-point group "
        f'({architecture} = "package.module:NeuronClass"), or serve on the CPU with '
        f"VLLM_NEURON_BACKEND=reference."
    )


def resolve_model_class(
    architecture: str,
    model_types: Mapping[str, Mapping[str, NxDIModelClass]],
    entry_points: Iterable[importlib.metadata.EntryPoint],
    nxdi_version: str | None = None,
) -> NxDIModelClass:
    """The NxDI application class for `architecture`; a registered entry point wins
    over the built-in table, so a contrib model can replace a built-in one."""
    refuse_vision_language(architecture)
    for ep in entry_points:
        if ep.name == architecture:
            cls = ep.load()
            if not (hasattr(cls, "get_neuron_config_cls") and hasattr(cls, "get_config_cls")):
                raise NeuronConfigError(
                    f"entry point {ENTRY_POINT_GROUP}:{ep.name} = {ep.value} is not an NxDI "
                    f"application class (no get_neuron_config_cls/get_config_cls); point it "
                    f"at a NeuronBaseForCausalLM subclass."
                )
            logger.info("NxDI model for %s: %s (entry point)", architecture, ep.value)
            return cls
    if architecture not in ARCHITECTURES:
        raise NeuronConfigError(_unsupported(architecture))
    key = ARCHITECTURES[architecture]
    if key not in model_types or TASK not in model_types[key]:
        since = (
            f" (NxDI lists it from {LISTED_FROM[key]}, a release for Trn2 and newer "
            f"only: not on inf2/trn1)"
            if key in LISTED_FROM
            else ""
        )
        raise NeuronConfigError(
            f"the installed NxD Inference {nxdi_version or '(unknown version)'} has no "
            f"{key!r} model in MODEL_TYPES{since}, needed for {architecture}; serve it "
            f"on a host whose Neuron SDK lists it (docs/serving/architectures.md), register "
            f"an NxDI contrib class under the {ENTRY_POINT_GROUP!r} entry point, or serve "
            f"on the CPU with VLLM_NEURON_BACKEND=reference."
        )
    return model_types[key][TASK]
