"""A fused draft model on the reference backend (NxDI's fused speculation): its
decoder, weights and KV cache, which has the target's slots (see `speculative`)."""

from __future__ import annotations

from pathlib import Path

import torch

from neuron_plugin.backends.reference.decoder import (
    DecoderSpec,
    decoder_graph,
    load_weights,
    rope_tables,
    weight_shapes,
)
from neuron_plugin.core.checkpoint import read_hf_config, safetensors_shapes
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings


class Draft:
    """See the module docstring."""

    def __init__(self, settings: NeuronSettings, target: DecoderSpec):
        assert settings.draft_model is not None
        self.model_dir = Path(settings.draft_model)
        self.hf_config = read_hf_config(self.model_dir)
        self.spec = DecoderSpec.from_hf_config(self.hf_config)
        if self.spec.vocab_size != target.vocab_size:
            raise NeuronConfigError(
                f"--speculative-config model={settings.draft_model}: the draft's vocabulary "
                f"has {self.spec.vocab_size} tokens, the target's {target.vocab_size}; a "
                f"draft model must share the target's tokenizer and vocabulary."
            )
        self.module = decoder_graph(self.spec, rope_tables(self.hf_config, self.spec))
        self.architecture = self.spec.architecture
        self.weights: list[torch.Tensor] = []
        self.state: tuple[torch.Tensor, ...] = ()  # its KV cache (K, V)

    def placeholders(self, dtype: torch.dtype) -> list[torch.Tensor]:
        shapes = weight_shapes(self.spec, safetensors_shapes(self.model_dir))
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]

    def caches(self, slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        k_cache = torch.zeros(s.num_layers, slots, s.num_kv_heads, s.head_dim, dtype=dtype)
        return k_cache, k_cache.clone()

    def load(self, slots: int, dtype: torch.dtype) -> None:
        self.weights = load_weights(self.model_dir, self.spec, dtype)
        self.state = self.caches(slots, dtype)
