"""Qwen3: Llama with RMS-normed queries and keys; Qwen2's window rule."""

from neuron_plugin.backends.reference.architecture import Architecture, from_max_window_layers

ARCHITECTURES = {
    "Qwen3ForCausalLM": Architecture(
        "qwen3", qk_norm=True, window_flag=True, sliding_layer=from_max_window_layers
    )
}
