"""The reference decoders as one fixed-shape function of (weights, inputs, KV cache).

The function is what a bucket's graph computes. Weights are inputs rather than module
parameters so that compiled graphs do not embed the checkpoint (the compile-cache key then
depends on the architecture, not on the weights), and the KV cache is an input mutated in
place, as NxDI's compiled models alias their cache. What differs between architectures is
data (`architectures.ARCHITECTURES`) and the MLP kinds of `mlp`.

Every bucket uses the same signature; only shapes differ:
  input_ids, positions, write_slots: [batch, active]   tokens computed this call
  read_slots:                        [batch, width]    cache slot of key position j
  full_context_lens, last_index:     [batch]
  k_cache, v_cache:                  [layers, slots, kv_heads, head_dim]
Key position j of row b is visible to a query at position q when j <= q,
j < full_context_lens[b] and, in a layer with a sliding window w, q - j < w (transformers'
`sliding_window_overlay`: kv_idx > q_idx - sliding_window) and, in a Llama 4 layer with
chunked attention of chunk c, j // c == q // c (transformers' `chunked_overlay`).
Sliding-window and chunked layers keep the full-length cache line (or block table) and
mask the keys outside the window or chunk, rather than NxDI's rolling window-sized cache:
the same attention, a larger cache. Masked scores
use the dtype's minimum (not -inf) so fully padded rows stay finite and never poison the
cache with NaNs. Key positions no query of a row sees are read from a slot the row
does see before the probabilities multiply their values: a masked weight is 0, but
0 x NaN is NaN, and a cache slot a row does not see holds whatever an earlier request
left there (`seen_slots`; `COMPUTATION` counts
such changes in what a graph computes: it is part of the compile-cache key).

With on-device sampling the graph also takes the call's `SamplingInputs` arrays
(top_k, top_p, temperature: [batch], uniform: [batch, draws]) and returns (logits,
tokens): the sampler is compiled into every bucket's graph, as NxDI compiles its own
(see `sampler`).

With LoRA (core.lora) the graph also takes the adapter slots, an A [slots, rank, in] and
a B [slots, out, rank] tensor per layer and target module (`lora_weights`, layer by
layer, modules in `lora_modules` order), and each row's slot (`adapter_slots` [batch]):
every targeted projection adds B[slot] (A[slot] x) to its row, PEFT's
y = W x + scaling * B(A x) with the scaling already in B (core.adapters). Slot 0 is
zero, so rows without an adapter compute the base model exactly.

A vision-language model's graphs (Qwen2-VL family and Qwen3-VL, core.vision) also take
rope_positions [3, batch, active] (M-RoPE: each rotary frequency follows the temporal,
height or width position, by the config's mrope_section, interleaved for Qwen3-VL), and
in context encoding the image embeddings vision_embeddings [batch, active, width] and
vision_mask [batch, active]: the first hidden values replace the token embeddings where
the mask is set (zeros and False in a call without images); Qwen3-VL's further hidden
values per DeepStack level are added to the output of layer 0, 1, ... there.
Their vision towers are graphs of their own (`vision`).

A hybrid model's graphs (Qwen3.5's gated DeltaNet layers, core.recurrent_state) also
take each state layer's per-sequence state, mutated in place like the KV cache:
conv_state [state layers, state slots, conv channels, kernel - 1] (the model's dtype) and
recurrent_state [state layers, state slots, value heads, key dim, value dim] (float32),
and state_slots [batch, 2, state layers]: the slot each row's state is read from (-1: it
starts from zeros, a new sequence) and the slot it is left in (`StateStep`).

Speculative decoding's graphs (`speculative`) are built from the same pieces (`hidden`,
`head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

from neuron_plugin.backends.prompt_logprobs import top_logprobs
from neuron_plugin.backends.reference.architectures import (
    DecoderSpec,
    UnsupportedModelError,
    rope_tables,
)
from neuron_plugin.backends.reference.layers import l2_norm, rms_norm, rotate, softcap
from neuron_plugin.backends.reference.mlp import Adapt, mlp, mlp_weights
from neuron_plugin.backends.reference.sampler import sample
from neuron_plugin.core import mxfp4
from neuron_plugin.core.checkpoint import canonical_tensor_name, safetensors_files

# Bumped whenever what a graph computes changes (the vision graphs' too), so compiled
# graphs of earlier code are cache misses (2: values of unseen key positions zeroed;
# 3: prompt logprobs through the vocabulary-sharded log-sum-exp, backends.prompt_logprobs;
# 4: Qwen3-VL's and Pixtral's graphs, built on branches beside 3; 5: K and V gathered
# by whole rows and never copied per head group, `attend`; 6: hybrid models' state
# inputs; 7: K and V gathered kv-head-major, in the layout the products read, `gather`,
# and a row's unseen key positions read from a slot it sees, `seen_slots`).
COMPUTATION = 7

__all__ = [
    "DecoderGraph",
    "DecoderSpec",
    "UnsupportedModelError",
    "decoder_graph",
    "load_weights",
    "rope_tables",
    "weight_names",
    "weight_shapes",
]

WeightSources = list[tuple[str, tuple[str, ...]]]


def weight_sources(spec: DecoderSpec, quantized: frozenset[str] = frozenset()) -> WeightSources:
    """The graph's weight inputs in order: (name, checkpoint tensors it is made of; more
    than one are stacked, see `mlp`); with a quantized checkpoint each module of
    `quantized` also has its `.scale`, and lm_head its own weight even when tied."""
    return _with_scales(_weight_sources(spec, "lm_head" in quantized), quantized)


def _with_scales(sources: WeightSources, quantized: frozenset[str]) -> WeightSources:
    out: WeightSources = []
    for name, parts in sources:
        out.append((name, parts))
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            out.append((module + ".scale", (module + ".scale",)))
    return out


def _weight_sources(spec: DecoderSpec, own_head: bool) -> WeightSources:
    if spec.arch.weight_sources is not None:  # the family's own layers
        return spec.arch.weight_sources(spec, own_head)
    arch = spec.arch
    names = ["model.embed_tokens.weight"]
    sources: WeightSources = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        names += [p + "input_layernorm.weight"]
        names += [attn + f"{x}_proj.weight" for x in "qkvo"]
        names += [attn + f"{x}_proj.bias" for x in spec.biased_projections]
        if arch.qk_norm:
            names += [attn + "q_norm.weight", attn + "k_norm.weight"]
        if arch.sinks:
            names.append(attn + "sinks")
        names.append(p + "post_attention_layernorm.weight")
        if arch.gemma:
            names += [
                p + "pre_feedforward_layernorm.weight",
                p + "post_feedforward_layernorm.weight",
            ]
        sources += [(n, (n,)) for n in names] + mlp_weights(spec, i)
        names = []
    names.append("model.norm.weight")
    if own_head or not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return sources + [(n, (n,)) for n in names]


def weight_names(spec: DecoderSpec, quantized: frozenset[str] = frozenset()) -> list[str]:
    """Canonical order of the weight tensors handed to the graph."""
    return [name for name, _ in weight_sources(spec, quantized)]


def weight_shapes(spec: DecoderSpec, shapes: dict[str, list[int]]) -> list[list[int]]:
    """The graph's weight shapes from the checkpoint's tensor shapes (safetensors
    headers; MXFP4 experts as their float weights), in `weight_names` order."""
    shapes = mxfp4.dequantized_shapes(shapes)
    wanted = weight_sources(spec)
    missing = [n for _, sources in wanted for n in sources if n not in shapes]
    if missing:
        raise UnsupportedModelError(
            f"the checkpoint lacks {len(missing)} tensors the {spec.architecture} graph "
            f"needs, e.g. {missing[:3]}"
        )
    return [
        [len(sources), *shapes[sources[0]]] if "*" in name else list(shapes[sources[0]])
        for name, sources in wanted
    ]


def load_weights(
    model_dir: str | Path, spec: DecoderSpec, dtype: torch.dtype
) -> list[torch.Tensor]:
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
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                found[canonical_tensor_name(name)] = f.get_tensor(name)
    mxfp4.dequantize_pairs(found)  # gpt-oss's experts as openai ships them
    wanted = weight_sources(spec)
    missing = [n for _, sources in wanted for n in sources if n not in found]
    if missing:
        raise UnsupportedModelError(
            f"checkpoint {model_dir} lacks {len(missing)} tensors the "
            f"{spec.architecture} graph needs, e.g. {missing[:3]}"
        )
    return [
        owned(torch.stack([found[n] for n in sources]) if "*" in name else found[sources[0]], dtype)
        for name, sources in wanted
    ]


def owned(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as `dtype`, contiguous, in memory of torch's own allocator (64-byte
    aligned). safetensors reads a tensor as a view of a memory map at its file offset
    (8-byte aligned, wherever the header length leaves it), and MKL's float32 GEMM
    rounds the last bits differently for 8- and 16-byte aligned operands: weights left
    there compute results that depend on the checkpoint's layout and differ between two
    processes that hold the same weights at different offsets."""
    return tensor.to(dtype=dtype, copy=True, memory_format=torch.contiguous_format)


def decoder_graph(
    spec: DecoderSpec,
    rope: dict[str, tuple[torch.Tensor, float]],
    candidates: int | None = None,
    lora_modules: tuple[str, ...] = (),
    quantized: frozenset[str] = frozenset(),
) -> DecoderGraph:
    """The architecture's decoder graph: its family's own (Architecture.graph) or the
    generic one."""
    graph = spec.arch.graph or DecoderGraph
    return graph(spec, rope, candidates, lora_modules, quantized)


class DecoderGraph(nn.Module):
    """One decoder step over a fixed-shape bucket (see the module docstring); with
    `candidates` (on-device sampling's global_topk, at most the vocabulary) it samples
    too. `rope` maps each layer type in use to its (inverse frequencies, attention
    scaling), see `architectures.rope_tables`."""

    def __init__(
        self,
        spec: DecoderSpec,
        rope: dict[str, tuple[torch.Tensor, float]],
        candidates: int | None = None,
        lora_modules: tuple[str, ...] = (),
        quantized: frozenset[str] = frozenset(),
    ):
        super().__init__()
        self.spec = spec
        self.lora_modules = lora_modules
        # Modules (paths, e.g. model.layers.0.self_attn.q_proj) whose weights are int8
        # with a scale (a quantized checkpoint, core.quantization).
        self.quantized = quantized
        self.names = weight_names(spec, quantized)
        self.rope_scaling = {kind: scaling for kind, (_, scaling) in rope.items()}
        # M-RoPE: which rotary position (0 temporal, 1 height, 2 width) each frequency
        # follows (`mrope_axes`).
        self.mrope_axis: torch.Tensor | None
        axis = mrope_axes(spec.mrope_section, spec.arch.mrope_interleaved)
        self.register_buffer("mrope_axis", torch.tensor(axis) if axis else None)
        for kind, (inv_freq, _) in rope.items():
            self.register_buffer(f"inv_freq_{kind}", inv_freq.float(), persistent=True)
        self.candidates = candidates
        # Gemma scales embeddings by sqrt(hidden_size), rounded to the weights' dtype.
        self.embed_scale = {
            dtype: float(torch.tensor(spec.hidden_size**0.5).to(dtype))
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
        }

    def forward(
        self,
        weights: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        last_index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        temperature: torch.Tensor | None = None,
        uniform: torch.Tensor | None = None,
        lora_weights: list[torch.Tensor] | None = None,
        adapter_slots: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
        vision_embeddings: torch.Tensor | None = None,
        vision_mask: torch.Tensor | None = None,
        prompt_targets: torch.Tensor | None = None,
        prompt_k: int = 0,
        state_slots: torch.Tensor | None = None,
        conv_state: torch.Tensor | None = None,
        recurrent_state: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The last real token's logits (and with a sampler its token); with
        `prompt_targets` [batch, active] also every position's prompt logprobs at
        `prompt_k` (backends.prompt_logprobs), appended to the answer; a hybrid model's
        state inputs as the module docstring says."""
        w = self.named(weights)
        vision = None
        if vision_embeddings is not None and vision_mask is not None:
            vision = (vision_embeddings, vision_mask)
        adapt = None
        if lora_weights is not None and adapter_slots is not None:
            adapt = self.lora_rows(lora_weights, adapter_slots)
        x = self.hidden(
            w,
            input_ids,
            positions,
            write_slots,
            read_slots,
            full_context_lens,
            k_cache,
            v_cache,
            adapt,
            rope_positions,
            vision,
            state=None
            if state_slots is None or conv_state is None or recurrent_state is None
            else (state_slots, conv_state, recurrent_state),
        )
        logits = self.head(w, x[torch.arange(x.shape[0]), last_index])
        scores = (
            ()
            if prompt_targets is None
            else top_logprobs(self.head(w, x), prompt_targets, prompt_k)
        )
        if self.candidates is None:
            return (logits, *scores) if scores else logits
        assert top_k is not None and top_p is not None
        assert temperature is not None and uniform is not None
        tokens = sample(logits, top_k, top_p, temperature, uniform[:, 0], self.candidates)
        return logits, tokens, *scores

    def named(self, weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, weights, strict=True))

    def lora_rows(
        self, lora_weights: list[torch.Tensor], adapter_slots: torch.Tensor
    ) -> list[Adapt]:
        """Per layer, the LoRA delta of each row's adapter: A and B gathered from the
        row's slot ([batch, rank, in], [batch, out, rank]), applied as B (A x)."""
        modules = self.lora_modules
        per_layer = 2 * len(modules)
        if len(lora_weights) != per_layer * self.spec.num_layers:
            raise ValueError(
                f"{len(lora_weights)} LoRA slot tensors for {self.spec.num_layers} layers "
                f"of {len(modules)} modules"
            )
        adapts: list[Adapt] = []
        for layer in range(self.spec.num_layers):
            chunk = lora_weights[layer * per_layer : (layer + 1) * per_layer]
            rows = {
                m: (chunk[2 * i][adapter_slots], chunk[2 * i + 1][adapter_slots])
                for i, m in enumerate(modules)
            }
            adapts.append(_lora_delta(rows))
        return adapts

    def linear(self, w: dict[str, torch.Tensor], module: str, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ bias) of `module` (its weight `module`.weight). A quantized module's
        int8 weight is cast to x's dtype for the matmul and the result scaled per output
        channel in float32 (neuronx-distributed QuantizedColumnParallel /
        QuantizedRowParallel: direct_cast_dequantize, then scale_dequantize)."""
        weight, bias = w[module + ".weight"], w.get(module + ".bias")
        if module not in self.quantized:
            return functional.linear(x, weight, bias)
        y = functional.linear(x, weight.to(x.dtype))
        y = (y.float() * w[module + ".scale"].reshape(-1)).to(x.dtype)
        return y if bias is None else y + bias

    def head(self, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states `x` [..., hidden]."""
        s = self.spec
        if "lm_head" in self.quantized:
            return softcap(self.linear(w, "lm_head", x), s.final_softcap).float()
        head = w["model.embed_tokens.weight"] if s.tie_word_embeddings else w["lm_head.weight"]
        return softcap(x @ head.t(), s.final_softcap).float()

    def hidden(
        self,
        w: dict[str, torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lora: list[Adapt] | None = None,
        rope_positions: torch.Tensor | None = None,
        vision: tuple[torch.Tensor, torch.Tensor] | None = None,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states [batch, active, hidden] of every input token,
        each token's keys and values written to its cache slot first; `lora`: per layer,
        the rows' adapter deltas (`lora_rows`). A vision-language model's M-RoPE
        rotates by `rope_positions` [3, batch, active], and `vision` (embeddings
        [batch, active, hidden x (1 + DeepStack levels)], mask [batch, active]) replaces
        the token embeddings where the mask is set (transformers' masked_scatter of the
        image features), its DeepStack levels added after the first layers there. A
        hybrid model's `state`: (state_slots, conv_state, recurrent_state)."""
        return self.hidden_states(
            w,
            input_ids,
            positions,
            write_slots,
            read_slots,
            full_context_lens,
            k_cache,
            v_cache,
            lora,
            rope_positions=rope_positions,
            vision=vision,
            state=state,
        )[0]

    def hidden_states(
        self,
        w: dict[str, torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        full_context_lens: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lora: list[Adapt] | None = None,
        rope_positions: torch.Tensor | None = None,
        vision: tuple[torch.Tensor, torch.Tensor] | None = None,
        capture: tuple[int, ...] = (),
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`hidden`, and the residual stream entering each layer of `capture` (index
        num_layers: leaving the last layer, before the final norm), in `capture`'s
        order: what an EAGLE-3 head fuses (vLLM `_maybe_add_hidden_state`)."""
        s = self.spec
        captured: dict[int, torch.Tensor] = {}
        x = self.embed(w, input_ids)
        deepstack: list[torch.Tensor] = []
        if vision is not None:
            embeddings, mask = vision
            # Qwen3-VL: the embedding, then one DeepStack level per early layer
            embedding, *deepstack = embeddings.to(x.dtype).split(s.hidden_size, dim=-1)
            x = torch.where(mask.unsqueeze(-1), embedding, x)
            deepstack = [torch.where(mask.unsqueeze(-1), d, 0) for d in deepstack]
        step = Step(
            positions=positions,
            rope=self.rope(positions, rope_positions, x.dtype),
            masks=self.masks(positions, read_slots.shape[1], full_context_lens),
            write_slots=write_slots.reshape(-1),
            read_slots=read_slots,
            k_cache=k_cache,
            v_cache=v_cache,
            per_layer=self.per_layer_inputs(w, input_ids, x),
            state=None if state is None else StateStep.of(state, positions, full_context_lens),
        )
        for layer in range(s.num_layers):
            if layer in capture:
                captured[layer] = x
            x = self.layer(w, layer, x, step, None if lora is None else lora[layer])
            if layer < len(deepstack):  # transformers' _deepstack_process
                x = x + deepstack[layer]
        captured[s.num_layers] = x
        normed = rms_norm(s.arch.norm, x, w["model.norm.weight"], s.rms_norm_eps)
        return normed, [captured[i] for i in capture]

    def embed(self, w: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (Gemma's scaled by sqrt(hidden_size))."""
        x = w["model.embed_tokens.weight"][input_ids]
        return x * self.embed_scale[x.dtype] if self.spec.arch.gemma else x

    def per_layer_inputs(
        self, w: dict[str, torch.Tensor], input_ids: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor | None:
        """What every layer takes besides the residual stream (none here; Gemma 4's
        per-layer embeddings)."""
        return None

    def rope(
        self, positions: torch.Tensor, rope_positions: torch.Tensor | None, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per RoPE table: (cos, sin) [batch, active, 1, rotary width] at the positions."""
        rope = {}
        for kind, scaling in self.rope_scaling.items():
            inv_freq = getattr(self, f"inv_freq_{kind}")
            # a vision model with 1-D RoPE (Pixtral's Mistral) has the vision graphs'
            # rope_positions input too, each axis its KV position: it rotates by those
            if rope_positions is None or self.mrope_axis is None:
                freqs = positions.unsqueeze(-1).float() * inv_freq
            else:  # [3, b, a] -> each frequency's own axis: [b, a, head_dim / 2]
                axis_positions = rope_positions[self.mrope_axis].permute(1, 2, 0)
                freqs = axis_positions.float() * inv_freq
            # Llama 4 rotates interleaved pairs, in float32 (`rotate`)
            pairs = self.spec.arch.llama4
            emb = freqs.repeat_interleave(2, -1) if pairs else torch.cat((freqs, freqs), -1)
            table = torch.float32 if pairs else dtype
            rope[kind] = (
                (emb.cos() * scaling).to(table).unsqueeze(2),
                (emb.sin() * scaling).to(table).unsqueeze(2),
            )
        return rope

    def masks(
        self, positions: torch.Tensor, width: int, full_context_lens: torch.Tensor
    ) -> dict[tuple[int | None, int | None], torch.Tensor]:
        """Per (window, chunk) in use: which key positions each query sees
        [batch, 1, 1, active, width] (see the module docstring)."""
        s = self.spec
        batch, active = positions.shape
        key_pos = torch.arange(width, dtype=positions.dtype).view(1, 1, width)
        query_pos = positions.unsqueeze(-1)
        causal = (key_pos <= query_pos) & (key_pos < full_context_lens.view(batch, 1, 1))
        return {  # in layer order: the exported graph is the same in every process
            (window, chunk): _restricted(causal, key_pos, query_pos, window, chunk).view(
                batch, 1, 1, active, width
            )
            for window, chunk in dict.fromkeys(
                (s.windows[i], s.chunk(i)) for i in range(s.num_layers)
            )
        }

    def layer(
        self,
        w: dict[str, torch.Tensor],
        layer: int,
        x: torch.Tensor,
        step: Step,
        adapt: Adapt | None,
    ) -> torch.Tensor:
        """One decoder layer on the residual stream `x` [batch, active, hidden], its keys
        and values written to the cache first."""
        s = self.spec
        batch, active = x.shape[:2]
        norm = s.arch.norm
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        h = rms_norm(norm, x, w[p + "input_layernorm.weight"], s.rms_norm_eps)
        q, k, v = (
            _with_delta(self.linear(w, f"{a}{n}_proj", h), adapt, f"{n}_proj", h) for n in "qkv"
        )
        q = q.view(batch, active, s.num_heads, s.head_dim)
        k = k.view(batch, active, s.num_kv_heads, s.head_dim)
        v = v.view(batch, active, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = rms_norm(norm, q, w[a + "q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(norm, k, w[a + "k_norm.weight"], s.rms_norm_eps)
        if s.uses_rope(layer):
            cos, sin = step.rope[s.rope_kind(layer)]
            q, k = (rotate(t, cos, sin, s.arch.llama4) for t in (q, k))
            if s.l2_qk_norm:
                q, k = l2_norm(q, s.rms_norm_eps), l2_norm(k, s.rms_norm_eps)
        elif s.temperature_tuning is not None:
            q = _tuned_temperature(q, step.positions, *s.temperature_tuning)
        step.write(layer, k, v)
        visible = step.mask(s, layer)
        keys, values = step.read(layer, s.num_kv_heads, s.head_dim, visible)
        attn = attend(s, q, keys, values, visible, w.get(a + "sinks"))
        out = _with_delta(self.linear(w, a + "o_proj", attn), adapt, "o_proj", attn)
        if s.arch.gemma:  # Gemma normalises the attention output too
            out = rms_norm(norm, out, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        x = x + out
        pre_mlp = "pre_feedforward_layernorm" if s.arch.gemma else "post_attention_layernorm"
        h = rms_norm(norm, x, w[f"{p}{pre_mlp}.weight"], s.rms_norm_eps)
        linear = (lambda m, x: self.linear(w, m, x)) if self.quantized else None
        out = mlp(s, w, layer, h, adapt, linear)
        if s.arch.gemma:
            out = rms_norm(norm, out, w[p + "post_feedforward_layernorm.weight"], s.rms_norm_eps)
        return x + out


@dataclass
class Step:
    """What every layer of one call shares: positions, RoPE tables, masks, the KV cache
    and the slots this call writes and reads, the per-layer inputs (Gemma 4)."""

    positions: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[tuple[int | None, int | None], torch.Tensor]
    write_slots: torch.Tensor  # [batch * active]
    read_slots: torch.Tensor  # [batch, width]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    per_layer: torch.Tensor | None = None
    state: StateStep | None = None

    def mask(self, s: DecoderSpec, layer: int) -> torch.Tensor:
        return self.masks[(s.windows[layer], s.chunk(layer))]

    def write(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This call's keys and values [batch, active, kv_heads, head_dim] into cache row
        `row` at the write slots; a layer narrower than the cache line (Gemma 4's layer
        types differ) fills its start."""
        line = self.k_cache.shape[-2] * self.k_cache.shape[-1]
        width = k.shape[-2] * k.shape[-1]
        rows = torch.full_like(self.write_slots, row)
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            flat = new.reshape(-1, width)
            if width < line:
                pad = torch.full((flat.shape[0], line - width), 0, dtype=flat.dtype)
                flat = torch.cat((flat, pad), dim=-1)
            cache.index_put_((rows, self.write_slots), flat.view(-1, *cache.shape[-2:]))

    def read(
        self, row: int, kv_heads: int, head_dim: int, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache row `row`'s keys and values [batch, kv_heads, width, head_dim] at the
        read slots (the start of each line where the layer is narrower than it), the
        positions the layer's mask `visible` hides from a row read from one it sees."""
        slots = seen_slots(self.read_slots, visible)
        return (
            gather(self.k_cache[row], slots, kv_heads, head_dim),
            gather(self.v_cache[row], slots, kv_heads, head_dim),
        )


@dataclass
class StateStep:
    """A hybrid model's per-sequence state in one call (see the module docstring): each
    row's slots per state layer, the state tensors, and how many of its tokens are real
    (the rest are the bucket's padding, which must leave the state as it is)."""

    read: torch.Tensor  # [batch, state layers]: slot, -1 where the state starts at zero
    write: torch.Tensor  # [batch, state layers]: slot the new state goes to
    conv: torch.Tensor  # [state layers, slots, conv channels, kernel - 1]
    recurrent: torch.Tensor  # [state layers, slots, value heads, key dim, value dim]
    tokens: torch.Tensor  # [batch] real tokens per row

    @classmethod
    def of(
        cls,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        full_context_lens: torch.Tensor,
    ) -> StateStep:
        slots, conv, recurrent = state
        # a row computes positions[0] .. full_context_len - 1; a padding row none
        tokens = (full_context_lens - positions[:, 0]).clamp(min=0, max=positions.shape[1])
        return cls(slots[:, 0], slots[:, 1], conv, recurrent, tokens)

    def load(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """State layer `index`'s (conv [batch, channels, kernel - 1], recurrent [batch,
        heads, key dim, value dim]) of every row: zeros where it starts anew."""
        read = self.read[:, index]
        fresh = (read < 0).view(-1, 1, 1)
        slots = read.clamp(min=0)
        conv = torch.where(fresh, 0, self.conv[index][slots])
        recurrent = torch.where(fresh.unsqueeze(-1), 0, self.recurrent[index][slots])
        return conv, recurrent

    def store(self, index: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Every row's new state of state layer `index` into its write slot."""
        rows = torch.full_like(self.write[:, index], index)
        self.conv.index_put_((rows, self.write[:, index]), conv.to(self.conv.dtype))
        self.recurrent.index_put_((rows, self.write[:, index]), recurrent.float())


def _restricted(
    causal: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    window: int | None,
    chunk: int | None,
) -> torch.Tensor:
    """The causal mask within a sliding window and within an attention chunk."""
    visible = causal
    if window is not None:
        visible = visible & (query_pos - key_pos < window)
    if chunk is not None:
        visible = visible & (key_pos // chunk == query_pos // chunk)
    return visible


def _tuned_temperature(
    q: torch.Tensor, positions: torch.Tensor, floor_scale: float, attn_scale: float
) -> torch.Tensor:
    """Llama 4's attention temperature tuning of a NoPE layer's queries [b, a, heads, d]
    by their positions [b, a]."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * scales.view(*positions.shape, 1, 1)).to(q.dtype)


def mrope_axes(section: tuple[int, ...], interleaved: bool) -> list[int]:
    """Which M-RoPE position (0 temporal, 1 height, 2 width) each of the head_dim / 2
    rotary frequencies follows: three runs of mrope_section's lengths (Qwen2-VL's
    split), or, interleaved (Qwen3-VL's recomposition_frequencies), frequency i takes
    height where i % 3 == 1 and i < 3 x section[1], width where i % 3 == 2 and
    i < 3 x section[2], temporal elsewhere."""
    if not interleaved:
        return [i % 3 for i, n in enumerate(section) for _ in range(n)]
    return [i % 3 if i % 3 and i < 3 * section[i % 3] else 0 for i in range(sum(section))]


def _lora_delta(rows: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Adapt:
    def delta(module: str, x: torch.Tensor) -> torch.Tensor | None:
        if module not in rows:
            return None
        a, b = rows[module]  # [batch, rank, in], [batch, out, rank]
        return (x @ a.transpose(1, 2)) @ b.transpose(1, 2)

    return delta


def _with_delta(y: torch.Tensor, adapt: Adapt | None, module: str, x: torch.Tensor) -> torch.Tensor:
    delta = None if adapt is None else adapt(module, x)
    return y if delta is None else y + delta


def seen_slots(slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`slots` [b, width] with each key position that no query of its row sees (mask
    `visible` [b or 1, 1, 1, active, width]) pointed at one the row does see. Its
    weight is 0, but 0 x NaN is NaN, and such a slot holds whatever an earlier request
    left there; the row's own keys and values are finite wherever its output is. (Zeroing
    the gathered values instead was one more pass over them per layer.)"""
    seen = visible.any(dim=-2).reshape(visible.shape[0], -1).expand(slots.shape)
    some = seen.to(torch.int64).max(dim=-1, keepdim=True).indices  # a seen position
    return torch.where(seen, slots, slots.gather(1, some))


def gather(
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> torch.Tensor:
    """The first `kv_heads` heads of `head_dim` values (the cache's own by default) of
    each cache line [slots, line] at `slots` [b, width], kv-head-major: [b, kv_heads,
    width, head_dim], the layout both attention products read, so neither copies K or V
    again (transposing them after the gather was a pass over each per layer, as large as
    the gather). Each head's values are copied as one row (index_select copies whole
    rows; indexing copies element by element, several times slower)."""
    kv = cache.shape[-2] if kv_heads is None else kv_heads
    dim = cache.shape[-1] if head_dim is None else head_dim
    line = cache.shape[-2] * cache.shape[-1]
    if line % dim or kv * dim > line:
        raise ValueError(f"{kv} heads of {dim} values do not tile a cache line of {line}")
    heads = torch.arange(kv, dtype=slots.dtype).view(1, kv, 1)
    rows = slots.unsqueeze(1) * (line // dim) + heads  # [b, kv, width]
    picked = cache.reshape(-1, dim).index_select(0, rows.reshape(-1))
    return picked.view(slots.shape[0], kv, slots.shape[1], dim)


def attend(
    s: DecoderSpec,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Grouped-query attention of q [b, active, heads, d] over keys/values
    [b, kv_heads, width, d] (`gather`); `sinks` [heads] (gpt-oss) join each softmax as one more
    logit whose probability is dropped. The heads that share a KV head are stacked along
    the queries ([b, kv_heads, groups x active, d]), so K and V are not broadcast to every
    head of a group: that copied them, transposed, in each layer of each call, which cost
    more than the products themselves at decode. (torch's fused attention would need K
    zeroed at unseen slots as well as V, which costs what it saves.)"""
    batch, active = q.shape[:2]
    kv, width, dim = keys.shape[1:]  # the layer's (Gemma 4's layer types differ)
    groups = s.num_heads // kv
    qg = q.view(batch, active, kv, groups, dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, kv, groups * active, dim)
    scores = (qg @ keys.transpose(2, 3)).view(batch, kv, groups, active, width)
    scores = softcap(scores * s.score_scale, s.attn_softcap)  # [b, kv, g, active, width]
    scores = torch.where(visible, scores, torch.finfo(q.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, kv, groups, 1, 1)
        scores = torch.cat((scores, sink.expand(batch, -1, -1, active, 1)), dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    # positions a row does not see hold its own values (seen_slots): 0 x finite
    out = probs.reshape(batch, kv, groups * active, width) @ values
    return (
        out.view(batch, kv, groups, active, dim).permute(0, 3, 1, 2, 4).reshape(batch, active, -1)
    )
