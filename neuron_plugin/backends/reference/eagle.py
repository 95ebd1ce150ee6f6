"""The reference backend's EAGLE graphs (core.eagle_heads, core.speculation): an EAGLE or
EAGLE-3 head fused into the graphs with the target, as NxDI's EAGLE speculation is
(model_base.py `_eagle_context_encoding_forward`, `_eagle_token_gen_forward`).

The head's element at token position t is (token t, the target's hidden state at t - 1),
at RoPE position t - 1: vLLM's and NxDI's "draft runs one position behind the target".
It is stored in the head's KV cache at token t's slot, so the cache has the target's
slot geometry (block tables, prefix-cache hits and preemption apply alike) and the
element of a slot depends on the tokens up to that position only. Position 0 has no
element: the head attends to key positions 1..t.

The target's per-position state the head reads, its hidden state (EAGLE-3: the `fc`
fusion of the layers it taps), is kept per slot too (`hidden_cache`), written by every
target computation (context encoding and verification).

- `EaglePrefillGraph`: the target's context encoding, which also writes the hidden
  states of the chunk and runs the head over it (the first position of a chunk reads
  the hidden state before it from the cache).
- `EagleDecodeGraph`: one token per row in; the head drafts speculation_length - 1
  tokens from the last token and the hidden state before it (each next step from its own
  output, as EAGLE chains), the target verifies them (`sampler.verify`), then the head
  runs once more over every position with the target's hidden states, so the elements
  of accepted positions are EAGLE's own (NxDI's "final draft run to update KV cache").
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from neuron_plugin.backends.reference.architectures import (
    DecoderSpec,
    UnsupportedModelError,
    rope_tables,
)
from neuron_plugin.backends.reference.decoder import (
    DecoderGraph,
    attend,
    gather,
    owned,
    seen_slots,
)
from neuron_plugin.backends.reference.layers import rms_norm, rotate_half
from neuron_plugin.backends.reference.mlp import mlp
from neuron_plugin.backends.reference.sampler import sample, verify
from neuron_plugin.core.checkpoint import read_hf_config, safetensors_files, safetensors_shapes
from neuron_plugin.core.eagle_heads import EagleHead, TargetShape, read_head, tensor_name
from neuron_plugin.core.neuron_settings import EAGLE, EAGLE3

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def head_weight_names(head: EagleHead) -> list[str]:
    """The head's graph weight inputs in order (names as `tensor_name` gives them)."""
    names = ["fc.weight"]
    for i in range(head.num_layers):
        p = f"layers.{i}."
        if i > 0 or head.method == EAGLE3:
            names.append(p + "input_layernorm.weight")
        if i == 0 and head.method == EAGLE3:
            names.append(p + "hidden_norm.weight")
        names += [f"{p}self_attn.{n}.weight" for n in _ATTENTION]
        names.append(p + "post_attention_layernorm.weight")
        names += [f"{p}mlp.{n}.weight" for n in _MLP]
    if head.method == EAGLE3:
        names += ["norm.weight", "lm_head.weight", "d2t"]
    elif head.own_lm_head:
        names.append("lm_head.weight")
    if head.own_embedding:
        names.append("embed_tokens.weight")
    return names


class HeadGraph(nn.Module):
    """The head's computation on the graphs' tensors (see the module docstring)."""

    inv_freq: torch.Tensor  # RoPE's inverse frequencies (a buffer)

    def __init__(self, head: EagleHead, config: dict, target: DecoderGraph):
        super().__init__()
        self.head = head
        self.target = target
        self.spec = DecoderSpec.from_hf_config({**config, "architectures": ["LlamaForCausalLM"]})
        if self.spec.attention_bias:
            raise UnsupportedModelError("an EAGLE head with attention_bias is not supported")
        self.names = head_weight_names(head)
        ((inv_freq, scaling),) = rope_tables(config, self.spec).values()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=True)
        self.rope_scaling = scaling
        # The target layers whose input an EAGLE-3 head fuses (num_layers: the last's output).
        self.capture = head.aux_layers

    def named(self, weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, weights, strict=True))

    def feature(
        self, hw: dict[str, torch.Tensor], final: torch.Tensor, aux: list[torch.Tensor]
    ) -> torch.Tensor:
        """What the head reads of the target at a position: its final (normed) hidden
        state (EAGLE), or `fc` over the tapped layers' (EAGLE-3, vLLM
        `combine_hidden_states`)."""
        if self.head.method == EAGLE:
            return final
        return torch.cat(aux, dim=-1) @ hw["fc.weight"].t()

    def run(
        self,
        hw: dict[str, torch.Tensor],
        w: dict[str, torch.Tensor],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head on elements (tokens [b, s], hidden [b, s, H]) at token positions
        `positions`, each element's keys and values written to its slot first: (the
        states its logits come from, the hidden state a chained next step reads)."""
        s, head = self.spec, self.head
        batch, active = tokens.shape
        width = read_slots.shape[1]
        embed = hw.get("embed_tokens.weight", w["model.embed_tokens.weight"])[tokens]
        freqs = (positions - 1).unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(embed.dtype).unsqueeze(2)
        sin = (emb.sin() * self.rope_scaling).to(embed.dtype).unsqueeze(2)
        key_pos = torch.arange(width, dtype=positions.dtype).view(1, 1, width)
        query_pos = positions.unsqueeze(-1)
        visible = ((key_pos >= 1) & (key_pos <= query_pos)).view(batch, 1, 1, active, width)
        flat_write = write_slots.reshape(-1)
        eps = s.rms_norm_eps
        if head.method == EAGLE:
            x = torch.cat((embed, hidden), dim=-1) @ hw["fc.weight"].t()
        elif head.norm_before_residual:
            x = rms_norm("rms", hidden, hw["layers.0.hidden_norm.weight"], eps)
        else:
            x = hidden
        for layer in range(s.num_layers):
            p = f"layers.{layer}."
            if layer == 0 and head.method == EAGLE3:
                h = torch.cat(
                    (
                        rms_norm("rms", embed, hw[p + "input_layernorm.weight"], eps),
                        rms_norm("rms", hidden, hw[p + "hidden_norm.weight"], eps),
                    ),
                    dim=-1,
                )
            elif layer == 0:  # EAGLE's first layer has no input norm
                h = x
            else:
                h = rms_norm("rms", x, hw[p + "input_layernorm.weight"], eps)
            a = p + "self_attn."
            q = (h @ hw[a + "q_proj.weight"].t()).view(batch, active, s.num_heads, s.head_dim)
            k = (h @ hw[a + "k_proj.weight"].t()).view(batch, active, s.num_kv_heads, s.head_dim)
            v = (h @ hw[a + "v_proj.weight"].t()).view(batch, active, s.num_kv_heads, s.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            layer_idx = torch.full_like(flat_write, layer)
            k_cache.index_put_((layer_idx, flat_write), k.reshape(-1, s.num_kv_heads, s.head_dim))
            v_cache.index_put_((layer_idx, flat_write), v.reshape(-1, s.num_kv_heads, s.head_dim))
            out = attend(
                s,
                q,
                gather(k_cache[layer], seen_slots(read_slots, visible)),
                gather(v_cache[layer], seen_slots(read_slots, visible)),
                visible,
                None,
            )
            x = x + out @ hw[a + "o_proj.weight"].t()
            h = rms_norm("rms", x, hw[p + "post_attention_layernorm.weight"], eps)
            x = x + mlp(s, {f"model.{n}": t for n, t in hw.items() if n.startswith(p)}, layer, h)
        if head.method == EAGLE:
            return x, x
        normed = rms_norm("rms", x, hw["norm.weight"], eps)
        return normed, normed if head.norm_output else x

    def draft(
        self, hw: dict[str, torch.Tensor], w: dict[str, torch.Tensor], states: torch.Tensor
    ) -> torch.Tensor:
        """The head's greedy token [b, s] (in the target's vocabulary) from `run`'s
        first answer: EAGLE-3 maps its draft id d to d + d2t[d]."""
        if self.head.method == EAGLE3:
            drafted = (states @ hw["lm_head.weight"].t()).float().max(dim=-1).indices
            return drafted + hw["d2t"][drafted]
        if "lm_head.weight" in hw:
            return (states @ hw["lm_head.weight"].t()).float().max(dim=-1).indices
        return self.target.head(w, states).max(dim=-1).indices


def _before(cache: torch.Tensor, read_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The hidden state [b, 1, H] at the position before each row's first."""
    previous = (positions[:, :1] - 1).clamp(min=0)
    return cache[read_slots.gather(1, previous)]


class EaglePrefillGraph(nn.Module):
    """A context encoding of the target that also feeds the head (module docstring)."""

    def __init__(self, head: HeadGraph):
        super().__init__()
        self.head = head

    def forward(
        self,
        weights: list[torch.Tensor],
        head_weights: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        last_index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        head_k_cache: torch.Tensor,
        head_v_cache: torch.Tensor,
        hidden_cache: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head, target = self.head, self.head.target
        w, hw = target.named(weights), head.named(head_weights)
        x, aux = target.hidden_states(
            w,
            input_ids,
            positions,
            write_slots,
            read_slots,
            full_context_lens,
            k_cache,
            v_cache,
            capture=head.capture,
        )
        features = head.feature(hw, x, aux)
        before = _before(hidden_cache, read_slots, positions)
        hidden_cache.index_put_(
            (write_slots.reshape(-1),), features.reshape(-1, features.shape[-1])
        )
        previous = torch.cat((before, features[:, :-1]), dim=1)
        head.run(
            hw,
            w,
            input_ids,
            previous,
            positions,
            write_slots,
            read_slots,
            head_k_cache,
            head_v_cache,
        )
        logits = target.head(w, x[torch.arange(x.shape[0]), last_index])
        assert target.candidates is not None  # speculation needs on-device sampling
        tokens = sample(logits, top_k, top_p, temperature, uniform[:, 0], target.candidates)
        return logits, tokens


class EagleDecodeGraph(nn.Module):
    """Drafts from the head and their verification in one graph (module docstring).
    `write_slots` [batch, speculation_length] are the slots of the positions the call
    computes (scratch past a row's budget), `last_index` each row's draft budget."""

    def __init__(self, head: HeadGraph, width: int):
        super().__init__()
        self.head = head
        self.width = width

    def forward(
        self,
        weights: list[torch.Tensor],
        head_weights: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        last_index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        head_k_cache: torch.Tensor,
        head_v_cache: torch.Tensor,
        hidden_cache: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head, target = self.head, self.head.target
        w, hw = target.named(weights), head.named(head_weights)
        start = positions[:, :1]
        token = input_ids[:, :1]
        before = _before(hidden_cache, read_slots, start)
        hidden = before
        candidates = [token]
        for i in range(self.width - 1):
            states, hidden = head.run(
                hw,
                w,
                token,
                hidden,
                start + i,
                write_slots[:, i : i + 1],
                read_slots,
                head_k_cache,
                head_v_cache,
            )
            token = head.draft(hw, w, states)
            candidates.append(token)
        proposed = torch.cat(candidates, dim=1)
        positions = start + torch.arange(self.width).unsqueeze(0)
        x, aux = target.hidden_states(
            w,
            proposed,
            positions,
            write_slots,
            read_slots,
            full_context_lens,
            k_cache,
            v_cache,
            capture=head.capture,
        )
        features = head.feature(hw, x, aux)
        hidden_cache.index_put_(
            (write_slots.reshape(-1),), features.reshape(-1, features.shape[-1])
        )
        logits = target.head(w, x)
        assert target.candidates is not None  # speculation needs on-device sampling
        tokens = verify(
            logits,
            proposed[:, 1:],
            last_index,
            top_k,
            top_p,
            temperature,
            uniform,
            target.candidates,
        )
        # The head again over every position, from the target's hidden states.
        head.run(
            hw,
            w,
            proposed,
            torch.cat((before, features[:, :-1]), dim=1),
            positions,
            write_slots,
            read_slots,
            head_k_cache,
            head_v_cache,
        )
        return logits[:, 0], tokens


class EagleState:
    """An EAGLE head beside the target: its graph piece, weights and `state`, the
    head's KV cache (K, V) and the per-slot hidden states it reads."""

    def __init__(self, method: str, folder: str | Path, target: DecoderGraph):
        self.model_dir = Path(folder)
        spec = target.spec
        if spec.arch.llama4:  # the head graph is a Llama layer
            raise UnsupportedModelError(
                f"{method} head for {spec.architecture}: Llama 4's EAGLE heads have Llama 4 "
                f"layers (vLLM's EagleLlama4ForCausalLM), which the reference backend does "
                f"not run; use a draft model or n-gram speculation."
            )
        self.head = read_head(
            method,
            str(folder),
            TargetShape(spec.hidden_size, spec.vocab_size, spec.num_layers),
        )
        self.module = HeadGraph(self.head, read_hf_config(folder), target)
        self.architecture = f"{method} head"
        self.weights: list[torch.Tensor] = []
        self.state: tuple[torch.Tensor, ...] = ()

    def _shapes(self) -> dict[str, list[int]]:
        shapes = {tensor_name(n): s for n, s in safetensors_shapes(self.model_dir).items()}
        shapes.setdefault("d2t", [self.head.draft_vocab_size])
        return shapes

    def placeholders(self, dtype: torch.dtype) -> list[torch.Tensor]:
        shapes = self._shapes()
        return [
            torch.zeros(shapes[n], dtype=torch.int64 if n == "d2t" else dtype)
            for n in self.module.names
        ]

    def caches(self, slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        s = self.module.spec
        k_cache = torch.zeros(s.num_layers, slots, s.num_kv_heads, s.head_dim, dtype=dtype)
        hidden = torch.zeros(slots, self.head.hidden_size, dtype=dtype)
        return k_cache, k_cache.clone(), hidden

    def load(self, slots: int, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        found: dict[str, torch.Tensor] = {}
        for path in safetensors_files(self.model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    found[tensor_name(name)] = f.get_tensor(name)
        found.setdefault("d2t", torch.zeros(self.head.draft_vocab_size, dtype=torch.int64))
        missing = [n for n in self.module.names if n not in found]
        if missing:
            raise UnsupportedModelError(
                f"EAGLE head {self.model_dir} lacks {len(missing)} tensors its "
                f"{self.head.method} graph needs, e.g. {missing[:3]}"
            )
        self.weights = [
            owned(found[n], torch.int64 if n == "d2t" else dtype) for n in self.module.names
        ]
        self.state = self.caches(slots, dtype)
