"""Qwen3-MoE: Qwen3's attention; MoE layers except mlp_only_layers and off the
decoder_sparse_step (`mlp`)."""

from neuron_plugin.backends.reference.architecture import Architecture

ARCHITECTURES = {
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe", qk_norm=True, mlp="qwen3_moe", window_flag=True, reads_layer_types=False
    )
}
