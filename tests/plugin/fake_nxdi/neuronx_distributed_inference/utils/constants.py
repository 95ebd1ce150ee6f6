"""MODEL_TYPES as in NxDI, reduced to the text models this double implements: "mistral"
only from the ef2731e sync on (0.7 to 0.9 as released have no entry, which the plugin
must report clearly), "gemma3" from 0.9 (0.8 ships models/gemma3 without an entry)."""

from neuronx_distributed_inference._release import RELEASE
from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM
from neuronx_distributed_inference.models.qwen3.modeling_qwen3 import NeuronQwen3ForCausalLM

MODEL_TYPES = {
    "llama": {"causal-lm": NeuronLlamaForCausalLM},
    "qwen3": {"causal-lm": NeuronQwen3ForCausalLM},
}
if RELEASE.startswith("0.9"):
    from neuronx_distributed_inference.models.gemma3.modeling_gemma3 import (
        NeuronGemma3ForCausalLM,
    )

    MODEL_TYPES["gemma3"] = {"causal-lm": NeuronGemma3ForCausalLM}
if RELEASE == "0.9-ef2731e":
    from neuronx_distributed_inference.models.mistral.modeling_mistral import (
        NeuronMistralForCausalLM,
    )

    MODEL_TYPES["mistral"] = {"causal-lm": NeuronMistralForCausalLM}
