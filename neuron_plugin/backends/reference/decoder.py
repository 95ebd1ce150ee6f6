"""Llama- and Qwen3-family decoders as one fixed-shape function of (weights, inputs, KV cache).

The function is what a bucket's graph computes. Weights are inputs rather than module
parameters so that compiled graphs do not embed the checkpoint (the compile-cache key then
depends on the architecture, not on the weights), and the KV cache is an input mutated in
place, as NxDI's compiled models alias their cache.

Every bucket uses the same signature; only shapes differ:
  input_ids, positions, write_slots: [batch, active]   tokens computed this call
  read_slots:                        [batch, width]    cache slot of key position j
  full_context_lens, last_index:     [batch]
  k_cache, v_cache:                  [layers, slots, kv_heads, head_dim]
Key position j of row b is visible to a query at position q when j <= q and
j < full_context_lens[b]; masked scores use the dtype's minimum (not -inf) so fully padded
rows stay finite and never poison the cache with NaNs.

With on-device sampling the graph also takes the call's `SamplingInputs` arrays
(top_k, top_p, temperature, uniform: [batch]) and returns (logits, tokens): the sampler
is compiled into every bucket's graph, as NxDI compiles its own (see `sample`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from neuron_plugin.core.checkpoint import safetensors_files

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


class UnsupportedModelError(ValueError):
    """The checkpoint is outside what the reference backend implements."""


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture facts the graph needs, read from a checkpoint's config.json."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @classmethod
    def from_hf_config(cls, config: dict) -> DecoderSpec:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures={archs} is not supported by the reference backend "
                f"(supported: {', '.join(FAMILIES)}); use VLLM_NEURON_BACKEND=nxd on a "
                f"Neuron host for other models."
            )
        heads = config["num_attention_heads"]
        return cls(
            architecture=arch,
            family=FAMILIES[arch],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config["rms_norm_eps"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
        )


def rope_inv_freq(config: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, exactly as transformers computes them."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exponents), 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError(
            "rope_type='dynamic' changes frequencies with the sequence length, which a "
            "fixed-shape graph cannot follow; use a checkpoint with static RoPE scaling."
        )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model(**config)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)


def weight_names(spec: DecoderSpec) -> list[str]:
    """Canonical order of the weight tensors handed to the graph."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight",
                  p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                  p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight"]
        if spec.attention_bias:
            names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                      p + "self_attn.v_proj.bias"]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "post_attention_layernorm.weight", p + "mlp.gate_proj.weight",
                  p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def load_weights(model_dir: str | Path, spec: DecoderSpec, dtype: torch.dtype) -> list[torch.Tensor]:
    """The checkpoint's safetensors, in `weight_names` order, in the serving dtype."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    if not files:
        raise UnsupportedModelError(
            f"no *.safetensors files in {model_dir}; the reference backend loads "
            f"safetensors checkpoints (convert with transformers' save_pretrained)."
        )
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                found[name] = f.get_tensor(name)
    wanted = weight_names(spec)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise UnsupportedModelError(
            f"checkpoint {model_dir} lacks {len(missing)} tensors the "
            f"{spec.architecture} graph needs, e.g. {missing[:3]}"
        )
    return [found[n].to(dtype).contiguous() for n in wanted]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def sample(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           temperature: torch.Tensor, uniform: torch.Tensor, candidates: int) -> torch.Tensor:
    """One token per row with vLLM's sampling semantics, as a fixed-shape function.

    Rows with top_k 1 take the argmax of the logits (vLLM's greedy). Others keep the
    `candidates` (global_topk) largest logits, divide them by the temperature, cut them to
    the row's top-k (ties with the k-th value stay, as in vLLM) and then to its top-p (a
    token stays while the probability before it is below top_p, vLLM's rule; NxDI's
    sampler also drops the token that crosses top_p), and draw by inverse CDF with the
    row's uniform number: one random input per row, made on the host, so the graph has
    no random operator and a row's draw costs 4 bytes across the runner's seam."""
    greedy = logits.max(dim=-1).indices
    values, indices = torch.topk(logits, candidates, dim=-1)
    kth = values.gather(-1, top_k.clamp(1, candidates).long().unsqueeze(-1) - 1)
    scaled = (values / temperature.unsqueeze(-1)).masked_fill(values < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    before = probs.cumsum(-1) - probs
    probs = probs.masked_fill(before >= top_p.unsqueeze(-1), 0.0)
    cumulative = probs.cumsum(-1)
    drawn = (cumulative <= uniform.unsqueeze(-1) * cumulative[:, -1:]).sum(-1, keepdim=True)
    # Float rounding may land past the last kept token; kept tokens are a prefix.
    last_kept = (probs > 0).sum(-1, keepdim=True) - 1
    token = indices.gather(-1, torch.minimum(drawn, last_kept)).squeeze(-1)
    return torch.where(top_k == 1, greedy, token)


class DecoderGraph(nn.Module):
    """One decoder step over a fixed-shape bucket (see the module docstring); with
    `candidates` (on-device sampling's global_topk, at most the vocabulary) it samples
    too."""

    def __init__(self, spec: DecoderSpec, inv_freq: torch.Tensor, attention_scaling: float,
                 candidates: int | None = None):
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", inv_freq.float(), persistent=True)
        self.attention_scaling = attention_scaling
        self.candidates = candidates

    def forward(self, weights: list[torch.Tensor], input_ids: torch.Tensor,
                positions: torch.Tensor, write_slots: torch.Tensor,
                read_slots: torch.Tensor, full_context_lens: torch.Tensor,
                last_index: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, top_k: torch.Tensor | None = None,
                top_p: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                uniform: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        batch, active = input_ids.shape
        width = read_slots.shape[1]
        groups = s.num_heads // s.num_kv_heads
        w = iter(weights)
        embed = next(w)
        x = embed[input_ids]
        dtype = x.dtype

        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(2)
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(2)

        key_pos = torch.arange(width, dtype=positions.dtype)
        visible = (key_pos.view(1, 1, width) <= positions.unsqueeze(-1)) & (
            key_pos.view(1, 1, width) < full_context_lens.view(batch, 1, 1))
        visible = visible.view(batch, 1, 1, active, width)
        flat_write = write_slots.reshape(-1)
        scale = 1.0 / math.sqrt(s.head_dim)
        floor = torch.finfo(dtype).min

        for layer in range(s.num_layers):
            ln_in, wq, wk, wv, wo = (next(w) for _ in range(5))
            h = _rms_norm(x, ln_in, s.rms_norm_eps)
            q, k, v = h @ wq.t(), h @ wk.t(), h @ wv.t()
            if s.attention_bias:
                q, k, v = q + next(w), k + next(w), v + next(w)
            q = q.view(batch, active, s.num_heads, s.head_dim)
            k = k.view(batch, active, s.num_kv_heads, s.head_dim)
            v = v.view(batch, active, s.num_kv_heads, s.head_dim)
            if s.qk_norm:
                q = _rms_norm(q, next(w), s.rms_norm_eps)
                k = _rms_norm(k, next(w), s.rms_norm_eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin

            layer_idx = torch.full_like(flat_write, layer)
            k_cache.index_put_((layer_idx, flat_write),
                               k.reshape(-1, s.num_kv_heads, s.head_dim))
            v_cache.index_put_((layer_idx, flat_write),
                               v.reshape(-1, s.num_kv_heads, s.head_dim))
            keys = k_cache[layer][read_slots]          # [b, width, kv, d]
            values = v_cache[layer][read_slots]

            qg = q.view(batch, active, s.num_kv_heads, groups, s.head_dim).permute(0, 2, 3, 1, 4)
            kt = keys.permute(0, 2, 3, 1).unsqueeze(2)  # [b, kv, 1, d, width]
            scores = (qg @ kt) * scale                  # [b, kv, g, active, width]
            scores = scores.masked_fill(~visible, floor)
            probs = torch.softmax(scores.float(), dim=-1).to(dtype)
            vg = values.permute(0, 2, 1, 3).unsqueeze(2)  # [b, kv, 1, width, d]
            attn = (probs @ vg).permute(0, 3, 1, 2, 4).reshape(batch, active, -1)
            x = x + attn @ wo.t()

            ln_post, gate, up, down = (next(w) for _ in range(4))
            h = _rms_norm(x, ln_post, s.rms_norm_eps)
            x = x + (nn.functional.silu(h @ gate.t()) * (h @ up.t())) @ down.t()

        x = _rms_norm(x, next(w), s.rms_norm_eps)
        last = x[torch.arange(batch), last_index]
        head = embed if s.tie_word_embeddings else next(w)
        logits = (last @ head.t()).float()
        if self.candidates is None:
            return logits
        return logits, sample(logits, top_k, top_p, temperature, uniform, self.candidates)
