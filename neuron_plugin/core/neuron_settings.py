"""The resolved configuration (`NeuronSettings`) and the vLLM limits it is resolved from.

Values only: `core.settings.resolve_settings` decides them. Kept apart from the
resolution so that modules the resolution uses (`core.memory`) can name the settings type
without importing the resolution back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bucketing.fit import prefix_caching_need
from neuron_plugin.core.quantization import Quantization
from neuron_plugin.core.recurrent_state import StateGeometry
from neuron_plugin.core.vision import VisionLimits

CONTIGUOUS = "contiguous"
BLOCK = "block"
# Speculative decoding methods (vLLM's --speculative-config "method" values served here).
NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
EAGLE = "eagle"
EAGLE3 = "eagle3"
# The methods whose drafter runs inside the token-generation graphs (fused speculation).
FUSED_METHODS = (DRAFT_MODEL, EAGLE, EAGLE3)
# The reason recorded when the user chose max_num_seqs (nothing to log or explain).
MAX_NUM_SEQS_CHOSEN = "--max-num-seqs"

# Keys of override_neuron_config that hold bucket grids.
GRID_KEYS = (
    "context_encoding_buckets",
    "token_generation_buckets",
    "prefix_buckets",
    "token_generation_batches",
)


@dataclass(frozen=True)
class EngineUpdate:
    """One value the platform writes back into vLLM's config, and why."""

    section: str  # the VllmConfig attribute: "cache_config", "scheduler_config", ...
    name: str
    value: Any
    reason: str


@dataclass(frozen=True)
class KVTransferLimits:
    """vLLM's --kv-transfer-config as the user gave it (the fields this platform reads;
    core.kv_transfer checks them)."""

    connector: str | None
    module_path: str | None
    role: str | None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLimits:
    """vLLM's settings as the user left them (before the platform changes anything):
    `block_size` is None unless the user chose one."""

    max_model_len: int
    max_num_seqs: int
    block_size: int | None
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    dtype: str
    tp_degree: int = 1
    # True when max_num_seqs is one of vLLM's own defaults (vLLM does not record whether
    # the user passed it).
    max_num_seqs_is_default: bool = False
    # Data-parallel engines on this host (vLLM's --data-parallel-size-local).
    dp_degree: int = 1
    num_gpu_blocks_override: int | None = None
    # vLLM flag -> its value, for the flags of core.vllm_flags.VLLM_FLAGS.
    vllm_flags: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's --speculative-config as given: its method ("ngram", "draft_model", ...),
    # num_speculative_tokens and the draft checkpoint (None for ngram).
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    draft_model: str | None = None
    # The target's (hidden_size, vocab_size, num_hidden_layers) from its config, which an
    # EAGLE head must fit (core.eagle_heads); None where the caller does not know them.
    target_shape: tuple[int, int, int] | None = None
    # vLLM's --enable-lora flags (core.lora): max_loras 0 means LoRA is off;
    # lora_target_modules None means vLLM's default (every module); lora_dtype as vLLM
    # holds it ("auto" or a dtype name).
    max_loras: int = 0
    max_lora_rank: int = 0
    max_cpu_loras: int = 0
    lora_target_modules: tuple[str, ...] | None = None
    lora_dtype: str | None = None
    fully_sharded_loras: bool = False
    # vLLM's --kv-transfer-config (prefill/decode disaggregation), None without it.
    kv_transfer: KVTransferLimits | None = None
    # A vision-language model's image sizes (its processor's patch range), None for a
    # text model.
    vision: VisionLimits | None = None
    # vLLM's --max-logprobs (-1: the whole vocabulary) and --logprobs-mode.
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    # The sampling parameters a request that sets none takes (vLLM's
    # ModelConfig.get_diff_sampling_param: the model's generation_config.json under
    # --generation-config auto, then --override-generation-config).
    default_sampling: Mapping[str, Any] = field(default_factory=dict)
    # A hybrid model's state layers (Qwen3.5's gated DeltaNet, core.recurrent_state),
    # None for a model whose every layer attends over a KV cache.
    state: StateGeometry | None = None


@dataclass(frozen=True)
class NeuronSettings:
    """Everything a backend needs to compile, load and run one configuration."""

    backend: str
    architecture: str
    dtype: str
    tp_degree: int
    max_model_len: int
    max_context_length: int
    max_num_seqs: int
    ctx_batch_size: int
    enable_bucketing: bool
    context_encoding_buckets: tuple[int, ...]
    prefix_buckets: tuple[int, ...]
    token_generation_buckets: tuple[int, ...]
    token_generation_batches: tuple[int, ...]
    kv_layout: str
    kv_layout_reason: str
    block_size: int
    num_blocks: int
    is_prefix_caching: bool
    is_chunked_prefill: bool
    on_device_sampling: bool
    # Candidates per row of the on-device sampler (OnDeviceSamplingConfig.global_topk).
    global_topk: int
    skip_warmup: bool
    passthrough: Mapping[str, Any] = field(default_factory=dict)
    # The interpreter of the environment the backend runs in (its own process behind the
    # runner protocol), or None for in-process. Changes no compiled graph.
    backend_python: str | None = None
    # Data-parallel engines on this host and each one's NeuronCores (empty where no core
    # is visible: the CPU reference backend). Change no compiled graph.
    dp_degree: int = 1
    rank_cores: tuple[tuple[int, ...], ...] = ()
    # Why max_num_seqs has its value (logged when it differs from vLLM's).
    max_num_seqs_reason: str = MAX_NUM_SEQS_CHOSEN
    # Requests without top_k (or above global_topk) sampled exactly on the host rather
    # than from the global_topk most likely tokens on the device. Changes no compiled graph.
    exact_sampling: bool = False
    # Speculative decoding (core.speculation): "ngram" (drafts proposed on the host,
    # verified by the token-generation graphs) or "draft_model" (a draft checkpoint
    # fused into them, NxDI's fused speculation), with vLLM's num_speculative_tokens
    # drafts per step; the draft's folder (its path changes no graph: its config is in
    # the compile-cache key instead).
    speculation_method: str | None = None
    num_speculative_tokens: int = 0
    draft_model: str | None = None
    # Context lengths (of token_generation_buckets) whose token-generation graphs also
    # have a logits twin (see token_generation_logits_shapes); default the largest.
    token_generation_logits_buckets: tuple[int, ...] = ()
    # What those twins mean for a request that sets no sampling parameters where it is
    # sampled on the host (bucket_grids.logits_note; '' otherwise). Changes no graph.
    logits_buckets_note: str = ""
    # Multi-LoRA (core.lora): adapter slots compiled in (max_loras; 0: LoRA off) of rank
    # max_lora_rank for the target modules; adapters held on the host (changes no
    # graph); the nxd backend's NxDI LoRA serving options (lora_config).
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    max_cpu_loras: int = 0
    lora_options: Mapping[str, Any] = field(default_factory=dict)
    # Vision-language models (core.vision): the vision encoder's buckets, in patches per
    # image, ascending (empty for a text model).
    vision_buckets: tuple[int, ...] = ()
    # Prompt logprobs (core.prompt_logprobs): the k of the context-encoding graphs that
    # return every prompt position's top-k logprobs (--max-logprobs), None: no such graphs.
    prompt_logprobs: int | None = None
    # Why the decode steps run in one batch size (max_num_seqs) by default; empty where
    # they get decode batch buckets (core.settings.one_batch_reason). Changes no graph.
    token_generation_batches_reason: str = ""
    # A hybrid model's state layers (core.recurrent_state; 0: none) and the KV cache
    # groups vLLM makes of them in the block layout (each request owns a state block per
    # group, `state_block_size` positions each).
    state_layers: int = 0
    state_groups: int = 0

    @property
    def quantization(self) -> Quantization | None:
        """NxDI weight quantization from the passed-through keys (core.quantization)."""
        return Quantization.from_override(self.passthrough)

    @property
    def lora_slots(self) -> int:
        """Adapter slots in the graphs: max_loras plus the base model's zero slot 0 (0
        without LoRA)."""
        return self.max_loras + 1 if self.max_loras else 0

    @property
    def is_block_layout(self) -> bool:
        return self.kv_layout == BLOCK

    @property
    def speculation_length(self) -> int:
        """NxDI's speculation_length: the positions a token-generation graph computes per
        row (the last token and num_speculative_tokens drafts), 0 without speculation."""
        return self.num_speculative_tokens + 1 if self.speculation_method else 0

    @property
    def is_fused_speculation(self) -> bool:
        """A draft model or an EAGLE head runs inside the token-generation graphs
        (NxDI's fused speculation): they take one token per row and propose the drafts
        themselves."""
        return self.speculation_method in FUSED_METHODS

    @property
    def is_eagle(self) -> bool:
        """The fused drafter is an EAGLE or EAGLE-3 head reading the target's hidden
        states (NxDI's enable_eagle_speculation)."""
        return self.speculation_method in (EAGLE, EAGLE3)

    @property
    def state_block_size(self) -> int:
        """Positions per state block of a hybrid model in the block layout: vLLM's
        mamba_block_size, the KV block size with prefix caching (its 'align' mode keeps
        the state at every block boundary), else max_model_len (its 'none' mode: one
        block per request)."""
        return self.block_size if self.is_prefix_caching else self.max_model_len

    @property
    def state_blocks(self) -> int:
        """The blocks of the block layout's count that hold a hybrid model's states,
        not KV (core.kv_layout.state_blocks_per_seq for each sequence slot)."""
        if not self.state_layers or not self.is_block_layout:
            return 0
        per_group = 2 if self.is_prefix_caching else 1
        return self.max_num_seqs * self.state_groups * per_group

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a padded block table (the NxD contract pads to this)."""
        return math.ceil(self.max_model_len / self.block_size)

    def context_encoding_shapes(self) -> list[tuple[int, ...]]:
        """(active tokens,) or, for the block layout, (active tokens, prefix length).

        The block layout lists the shapes NxDI's prefix-caching choice
        (`bucketing.fit.prefix_caching_fit`) sends some context of at most max_model_len
        tokens to: NxDI compiles the whole cross product, but the others never run, so
        they are neither warmed up, measured nor counted."""
        if not self.is_block_layout:
            return [(n,) for n in self.context_encoding_buckets]
        return [
            (n, p)
            for n in self.context_encoding_buckets
            for p in self.prefix_buckets
            if prefix_caching_need(
                self.context_encoding_buckets, self.prefix_buckets, (n, p), self.max_model_len
            )
            is not None
        ]

    def token_generation_shapes(self) -> list[tuple[int, int]]:
        """(batch, context length) for every token-generation graph."""
        return [
            (b, n) for b in self.token_generation_batches for n in self.token_generation_buckets
        ]

    def token_generation_logits_shapes(self) -> list[tuple[int, int]]:
        """(batch, context length) of the token-generation graphs compiled with logits
        beside the logits-free ones, which serve a decode step that has a host-sampled
        row. Only the nxd backend with on-device sampling splits them (its other
        token-generation graphs return tokens alone): one per context length of
        `token_generation_logits_buckets` (by default the largest only: a step with a
        host-sampled row runs there, whatever its rows' lengths), at the full batch (NxDI
        batch-buckets only
        its own token-generation submodel; backends/nxd/graphs.py). NxDI's tensor capture
        (`tensor_capture_config`) forces output_logits on and puts the captured tensors
        after the logits, so with it every graph keeps its logits (none are split).
        n-gram speculation splits NxDI's speculation model, which replaces its
        token-generation model, the same way (its logits are [batch, speculation_length,
        vocab] a call); fused speculation compiles no logits at all
        (backends/nxd/neuron_config.py). A vision-language model's decode graphs keep
        their logits too: NxDI's image-to-text text wrappers trace inputs for their own
        two submodels only (backends/nxd/image_to_text.py)."""
        if self.backend != "nxd" or not self.on_device_sampling or self.is_fused_speculation:
            return []
        if self.passthrough.get("tensor_capture_config") or self.vision_buckets:
            return []
        lengths = self.token_generation_logits_buckets or self.token_generation_buckets
        return [(self.max_num_seqs, n) for n in lengths]

    def vision_shapes(self) -> list[tuple[int]]:
        """(patches,) for every vision-encoder graph."""
        return [(n,) for n in self.vision_buckets]

    def capacity(self) -> str:
        """The KV cache's capacity in one line, the same in the server log and in
        explain-config. vLLM's own "KV cache size" line counts its null block, which
        holds no sequence, so it reads one block more."""
        vllm_tokens = self.num_blocks * self.block_size
        if not self.is_block_layout:
            return (
                f"{self.max_num_seqs} sequences of up to {self.max_model_len:,} tokens "
                f"({self.max_num_seqs * self.max_model_len:,} tokens); vLLM's \"KV cache "
                f'size" line also counts its null block ({vllm_tokens:,} tokens)'
            )
        usable = self.num_blocks - 1 - self.state_blocks  # >= max_num_seqs sequences
        states = (
            f" (and {self.state_blocks} blocks of the state layers' states)"
            if self.state_blocks
            else ""
        )
        return (
            f"{usable * self.block_size:,} tokens in {usable} blocks of {self.block_size}"
            f"{states}, {self.max_num_seqs} sequences of up to {self.max_model_len:,} tokens "
            f'at once; vLLM\'s "KV cache size" line also counts its null block '
            f"({vllm_tokens:,} tokens)"
        )

    def prompt_logprobs_shapes(self) -> list[tuple[int, ...]]:
        """The context-encoding shapes compiled a second time to return prompt logprobs
        (core.prompt_logprobs): all of them where `prompt_logprobs` is set."""
        return [] if self.prompt_logprobs is None else self.context_encoding_shapes()

    def graph_count(self) -> int:
        return (
            len(self.context_encoding_shapes())
            + len(self.prompt_logprobs_shapes())
            + len(self.token_generation_shapes())
            + len(self.token_generation_logits_shapes())
            + len(self.vision_shapes())
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["passthrough"] = dict(self.passthrough)
        data["lora_options"] = dict(self.lora_options)
        return json.loads(json.dumps(data))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NeuronSettings:
        values = dict(data)
        for key in (*GRID_KEYS, "token_generation_logits_buckets", "vision_buckets"):
            values[key] = tuple(values.get(key, ()))
        values["rank_cores"] = tuple(tuple(cores) for cores in values.get("rank_cores", ()))
        values["lora_target_modules"] = tuple(values.get("lora_target_modules", ()))
        return cls(**values)
