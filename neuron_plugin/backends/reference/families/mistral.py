"""Mistral: Llama's layers with a sliding window over every layer, no biases."""

from neuron_plugin.backends.reference.architecture import Architecture

ARCHITECTURES = {
    "MistralForCausalLM": Architecture("mistral", attention_bias="none", reads_layer_types=False)
}
