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
from neuron_plugin.core.vision import VISION_ARCHITECTURES

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
# Vision-language architectures -> their NxDI MODEL_TYPES key (utils/constants.py, 0.8
# and 0.9) and why the backend refuses them: what NxDI's CPU mode showed
# (tests/e2e/test_nxdi_vision.py, test_nxdi_llama4.py, docs/serving/vision.md).
VISION_LANGUAGE = {
    "Qwen2VLForConditionalGeneration": (
        "qwen2_vl",
        "measured on NxDI 0.8 and 0.9, its text model rotates image tokens by their 1-D "
        "position instead of Qwen2-VL's M-RoPE (NeuronQwen2VLRotaryEmbedding), so prompts "
        "with an image differ from transformers; a prompt that fills its context bucket "
        "comes out wrong; and on 0.8 every forward raises TypeError (tensor_capture_hook)",
    ),
    "Qwen3VLForConditionalGeneration": (
        "qwen3_vl",
        "NxDI's CPU mode cannot build it (to_cpu reads vocab_size from the top level of "
        "its config), so nothing about it is checked",
    ),
    "LlavaForConditionalGeneration": (
        "pixtral",
        "NxDI's CPU mode does not implement it (to_cpu), so nothing about it is checked",
    ),
    "Llama4ForConditionalGeneration": (
        "llama4",
        "measured on NxDI 0.8 and 0.9 (tests/e2e/test_nxdi_llama4.py), its text model "
        "ignores attn_temperature_tuning (NeuronLlama4Attention never scales the NoPE "
        "layers' queries) and the checkpoint's llama3 rope_scaling (NxD's "
        "precompute_freqs_cis applies its fixed ROPE_DEFAULTS: factor 8, frequency factors "
        "1 and 4, original context 8192), so its logits differ from transformers'; a "
        "prompt that fills its context bucket comes out wrong; and on 0.8 every forward "
        "raises NameError (tensor_capture_hook). Its vision encoder equals transformers'",
    ),
    "MllamaForConditionalGeneration": (
        "mllama",
        "vLLM itself no longer serves it: it was supported until vLLM 0.10.2 "
        "(vllm/model_executor/models/registry.py _PREVIOUSLY_SUPPORTED_MODELS: the "
        "encoder-decoder models went with vLLM's V0 engine)",
    ),
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
        key, why = VISION_LANGUAGE[architecture]
        fix = (
            "serve it with VLLM_NEURON_BACKEND=reference"
            if architecture in VISION_ARCHITECTURES
            else "the reference backend does not serve it either"
        )
        raise NeuronConfigError(
            f"architecture {architecture!r} is a vision-language model the nxd backend "
            f"does not serve: NxDI's MODEL_TYPES[{key!r}] is refused because {why} "
            f"(docs/serving/vision.md); {fix}."
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
