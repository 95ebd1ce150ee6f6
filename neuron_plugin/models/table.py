"""One row per Hugging Face architecture: its family (the module that serves it on each
backend: `backends/reference/families/<family>.py`, `backends/nxd/families/<family>.py`),
the tiny checkpoint the tests build of it, and per NxD Inference release where the nxd
backend's class comes from: NxDI's `MODEL_TYPES`, a module NxDI ships without listing it,
a class of the plugin's own (built on NxDI's base classes), or a refusal with its measured
reason. What each serves feature by feature is the family's support table
(`backends/nxd/families`), measured on real NxDI (`tests/e2e/test_nxdi_architectures.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from neuron_plugin.core.nxdi_releases import CHECKED

TASK = "causal-lm"  # the MODEL_TYPES task the nxd backend serves


@dataclass(frozen=True)
class NxDIModelType:
    """NxDI's own class, listed in its `utils.constants.MODEL_TYPES`."""

    key: str

    def describe(self) -> str:
        return f"NxDI MODEL_TYPES[{self.key!r}][{TASK!r}]"


@dataclass(frozen=True)
class NxDIModule:
    """NxDI's own class in a module the release ships without listing it in MODEL_TYPES
    (`path`: "module:Class" inside neuronx_distributed_inference)."""

    path: str

    def describe(self) -> str:
        return f"NxDI {self.path} (shipped, not in MODEL_TYPES)"


@dataclass(frozen=True)
class PluginClass:
    """A class of the plugin's own on NxDI's base classes ("module:Class")."""

    path: str

    def describe(self) -> str:
        return f"the plugin's {self.path}"


@dataclass(frozen=True)
class ThirdPartyClass:
    """A class registered under the entry-point group (`models.third_party`)."""

    path: str
    group: str

    def describe(self) -> str:
        return f"{self.path} (entry point {self.group})"


@dataclass(frozen=True)
class Refused:
    """Not served on this release, and why (measured, or read in NxDI's source)."""

    reason: str

    def describe(self) -> str:
        return f"refused: {self.reason}"


NxDSource = NxDIModelType | NxDIModule | PluginClass | ThirdPartyClass | Refused


@dataclass(frozen=True)
class ModelRow:
    """One architecture (config.json `architectures[0]`) and what serves it."""

    architecture: str
    name: str  # as the docs say it
    family: str  # the module that serves it on each backend
    # NxDI release ("0.8") -> where the nxd backend's class comes from
    nxd: Mapping[str, NxDSource]
    reference: bool = True  # served by the reference backend
    vision: bool = False  # a vision-language model (its tower: the family's module)
    # the checkpoints scripts/build_tiny_model.py builds of it (the first: the tests')
    tiny: tuple[str, ...] = ()
    note: str = ""  # what the docs add (e.g. "text only")


def _every_release(source: NxDSource) -> Mapping[str, NxDSource]:
    return MappingProxyType({r.release: source for r in CHECKED})


def _per_release(**sources: NxDSource) -> Mapping[str, NxDSource]:
    """Sources by release, keyword `r0_8` for "0.8"."""
    return MappingProxyType({k.removeprefix("r").replace("_", "."): v for k, v in sources.items()})


# NxDI has no Gemma 4 in any release (utils/constants.py MODEL_TYPES, 0.8 and 0.9): the
# plugin's own class on NxDI's base classes, measured equal on both
# (backends/nxd/families/gemma4).
_GEMMA4_NXD = PluginClass(
    "neuron_plugin.backends.nxd.families.gemma4.modeling:NeuronGemma4ForCausalLM"
)
# NxDI has no Qwen3.5 in any release (utils/constants.py MODEL_TYPES, 0.8 and 0.9): the
# plugin's own class for the text model, dense and MoE, measured equal on both
# (backends/nxd/families/qwen3_5).
_QWEN3_5_NXD = PluginClass(
    "neuron_plugin.backends.nxd.families.qwen3_5.modeling:NeuronQwen35ForCausalLM"
)
# NxDI's Qwen2-VL application (text model with patch qwen2-vl-mrope) around a vision
# encoder of the plugin's own that takes any grid (backends/nxd/families/qwen2_vl),
# measured equal on both releases
_QWEN2_VL_NXD = PluginClass(
    "neuron_plugin.backends.nxd.families.qwen2_vl.modeling:NeuronQwen2VLForImageToText"
)
# NxDI has no Qwen2.5-VL vision tower in any release: the same application with a tower of
# the plugin's own (window attention, RMSNorm, gated MLP), measured equal on both
_QWEN2_5_VL_NXD = PluginClass(
    "neuron_plugin.backends.nxd.families.qwen2_vl.modeling:NeuronQwen25VLForImageToText"
)

ROWS: tuple[ModelRow, ...] = (
    ModelRow(
        "LlamaForCausalLM",
        "Llama",
        "llama",
        _every_release(NxDIModelType("llama")),
        tiny=("llama",),
    ),
    ModelRow(
        "MistralForCausalLM",
        "Mistral",
        "mistral",
        # NxDI's Llama class on every release: 0.8 has no Mistral, and 0.9's sizes each
        # head as hidden / heads, ignoring the checkpoint's head_dim (Mistral Small 3's
        # 128 where that is 160: measured, its load fails); Llama's reads head_dim and
        # applies sliding_window as 0.9's Mistral does.
        _every_release(NxDIModelType("llama")),
        tiny=("mistral", "mistral_wide", "mistral_small"),
    ),
    ModelRow(
        "MixtralForCausalLM",
        "Mixtral",
        "mixtral",
        _every_release(NxDIModelType("mixtral")),
        tiny=("mixtral",),
    ),
    ModelRow(
        "Qwen2ForCausalLM",
        "Qwen2",
        "qwen2",
        _every_release(NxDIModelType("qwen2")),
        tiny=("qwen2",),
    ),
    ModelRow(
        "Qwen3ForCausalLM",
        "Qwen3",
        "qwen3",
        _every_release(NxDIModelType("qwen3")),
        tiny=("qwen3",),
    ),
    ModelRow(
        "Qwen3MoeForCausalLM",
        "Qwen3-MoE",
        "qwen3_moe",
        _every_release(NxDIModelType("qwen3_moe")),
        tiny=("qwen3_moe", "qwen3_moe_hub"),
    ),
    ModelRow(
        "DbrxForCausalLM",
        "DBRX",
        "dbrx",
        _every_release(NxDIModelType("dbrx")),
        reference=False,
        tiny=("dbrx",),
    ),
    ModelRow(
        "GptOssForCausalLM",
        "gpt-oss",
        "gpt_oss",
        _every_release(NxDIModelType("gpt_oss")),
        tiny=("gpt_oss", "gpt_oss_float"),
    ),
    ModelRow(
        "Gemma3ForCausalLM",
        "Gemma 3",
        "gemma3",
        _per_release(
            r0_8=NxDIModule("models.gemma3.modeling_gemma3:NeuronGemma3ForCausalLM"),
            r0_9=NxDIModelType("gemma3"),
        ),
        tiny=("gemma3", "gemma3_nxdi"),
        note="text",
    ),
    ModelRow(
        "Gemma4ForCausalLM",
        "Gemma 4",
        "gemma4",
        _every_release(_GEMMA4_NXD),
        tiny=("gemma4", "gemma4_moe"),
    ),
    ModelRow(
        "Gemma4ForConditionalGeneration",
        "Gemma 4 (multimodal checkpoint)",
        "gemma4",
        _every_release(_GEMMA4_NXD),
        tiny=("gemma4_mm",),
        note="its text model, served with --language-model-only",
    ),
    ModelRow(
        "Qwen3_5ForCausalLM",
        "Qwen3.5",
        "qwen3_5",
        _every_release(_QWEN3_5_NXD),
        tiny=("qwen3_5",),
        note="gated DeltaNet layers beside gated attention",
    ),
    ModelRow(
        "Qwen3_5MoeForCausalLM",
        "Qwen3.5-MoE",
        "qwen3_5",
        _every_release(_QWEN3_5_NXD),
        tiny=("qwen3_5_moe",),
        note="gated DeltaNet layers beside gated attention",
    ),
    ModelRow(
        "Qwen3_5ForConditionalGeneration",
        "Qwen3.5 (multimodal checkpoint)",
        "qwen3_5",
        _every_release(_QWEN3_5_NXD),
        tiny=("qwen3_5_mm",),
        note="its text model, served with --language-model-only",
    ),
    ModelRow(
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3.5-MoE (multimodal checkpoint)",
        "qwen3_5",
        _every_release(_QWEN3_5_NXD),
        note="its text model, served with --language-model-only",
    ),
    ModelRow(
        "Qwen2VLForConditionalGeneration",
        "Qwen2-VL",
        "qwen2_vl",
        _every_release(_QWEN2_VL_NXD),
        vision=True,
        tiny=("qwen2_vl", "qwen2_vl_tf5"),
        note="NxDI's image-to-text application with the plugin's own vision encoder "
        "(contiguous layout, no prefix caching, chunked prefill, speculation or LoRA)",
    ),
    ModelRow(
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2.5-VL",
        "qwen2_vl",
        _every_release(_QWEN2_5_VL_NXD),
        vision=True,
        tiny=("qwen2_5_vl",),
        note="NxDI's Qwen2-VL image-to-text application with the plugin's own Qwen2.5-VL "
        "vision tower (contiguous layout, no prefix caching, chunked prefill, speculation "
        "or LoRA)",
    ),
    ModelRow(
        "Qwen3VLForConditionalGeneration",
        "Qwen3-VL",
        "qwen3_vl",
        _every_release(NxDIModelType("qwen3_vl")),
        vision=True,
        tiny=("qwen3_vl",),
        note="NxDI's image-to-text application driven by the plugin (contiguous layout, "
        "no prefix caching, chunked prefill, speculation or LoRA)",
    ),
    ModelRow(
        "LlavaForConditionalGeneration",
        "Pixtral (Llava format)",
        "pixtral",
        _every_release(NxDIModelType("pixtral")),
        vision=True,
        tiny=("pixtral",),
    ),
    ModelRow(
        "Llama4ForConditionalGeneration",
        "Llama 4",
        "llama4",
        _every_release(NxDIModelType("llama4")),
        vision=True,
        tiny=("llama4",),
    ),
    ModelRow(
        "MllamaForConditionalGeneration",
        "Llama 3.2 Vision",
        "mllama",
        _every_release(
            Refused(
                "vLLM itself no longer serves it: it was supported until vLLM 0.10.2 "
                "(vllm/model_executor/models/registry.py _PREVIOUSLY_SUPPORTED_MODELS: the "
                "encoder-decoder models went with vLLM's V0 engine)"
            )
        ),
        reference=False,
        vision=True,
    ),
)
TABLE: Mapping[str, ModelRow] = MappingProxyType({row.architecture: row for row in ROWS})


def row(architecture: str) -> ModelRow | None:
    return TABLE.get(architecture)


def reference_architectures() -> tuple[str, ...]:
    return tuple(r.architecture for r in ROWS if r.reference)


def nxd_architectures(release: str) -> tuple[str, ...]:
    """The architectures the nxd backend serves with `release` (refusals excluded)."""
    return tuple(r.architecture for r in ROWS if not isinstance(r.nxd.get(release), Refused))


def vision_architectures() -> frozenset[str]:
    """The vision-language architectures whose towers the reference backend runs."""
    return frozenset(r.architecture for r in ROWS if r.vision and r.reference)
