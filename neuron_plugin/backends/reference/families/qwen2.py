"""Qwen2: biased q, k and v projections; a window (with use_sliding_window) from
max_window_layers on."""

from neuron_plugin.backends.reference.architecture import Architecture, from_max_window_layers

ARCHITECTURES = {
    "Qwen2ForCausalLM": Architecture(
        "qwen2", attention_bias="qkv", window_flag=True, sliding_layer=from_max_window_layers
    )
}
