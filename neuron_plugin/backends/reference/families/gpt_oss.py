"""gpt-oss: attention sinks, biased projections, a clamped SwiGLU MoE (`mlp`), even
layers sliding; its MXFP4 experts are read by core.mxfp4."""

from neuron_plugin.backends.reference.architecture import Architecture, even_layers

ARCHITECTURES = {
    "GptOssForCausalLM": Architecture(
        "gpt_oss",
        norm="rms_float",
        sinks=True,
        mlp="gpt_oss",
        sliding_layer=even_layers,
        default_rope_theta=150_000.0,
    )
}
