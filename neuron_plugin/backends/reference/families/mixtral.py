"""Mixtral: Mistral's attention with a MoE MLP (top-k softmax router, `mlp`)."""

from neuron_plugin.backends.reference.architecture import Architecture

ARCHITECTURES = {
    "MixtralForCausalLM": Architecture(
        "mixtral", attention_bias="none", mlp="mixtral", reads_layer_types=False
    )
}
