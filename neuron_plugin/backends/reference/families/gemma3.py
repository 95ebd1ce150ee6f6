"""Gemma 3 (text): (1 + weight) norms, normed attention and MLP outputs, scaled
embeddings, a local RoPE base for sliding layers, every sixth layer global by default."""

from neuron_plugin.backends.reference.architecture import Architecture, every_nth_full

ARCHITECTURES = {
    "Gemma3ForCausalLM": Architecture(
        "gemma3",
        norm="rms_one_plus",
        qk_norm=True,
        gemma=True,
        sliding_layer=every_nth_full,
        default_rope_theta=1_000_000.0,
    )
}
