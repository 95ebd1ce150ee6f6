"""vLLM's settings + `override_neuron_config` -> one resolved, frozen `NeuronSettings`.

Everything a backend needs is decided here, once, before anything compiles: the KV
layout and why, block size and count (vLLM's count includes its null block and equals
NxDI's `pa_num_blocks`), every bucket grid, and (`engine_updates`) which of these vLLM's
scheduler must be told. Users of vllm-neuron already write
`override_neuron_config` keys; they keep their meaning. Contradictions raise
`NeuronConfigError` naming both settings and the fix. This module is pure: no vLLM or
NxDI imports, so it is unit-tested over plain values.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bucketing.errors import BucketError
from bucketing.fit import prefix_caching_need
from bucketing.grids import align_up, nxdi_buckets, validate_grid
from neuron_plugin import BACKENDS
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.instances import core_slices
from neuron_plugin.core.memory import SequenceBudget
from neuron_plugin.core.sampling import DEFAULT_GLOBAL_TOPK, DISABLED_ENV
from neuron_plugin.core.vllm_flags import WORKER_CLS, flag_problems
from neuron_plugin.core.vllm_neuron_env import environment_problems

CONTIGUOUS = "contiguous"
BLOCK = "block"
DEFAULT_BLOCK_SIZE = 32
MIN_BUCKET = 128
# Sequence slots when the user leaves vLLM's GPU-sized default (vllm-neuron 0.x's default).
NEURON_DEFAULT_MAX_NUM_SEQS = 32
# The reason recorded when the user chose max_num_seqs (nothing to log or explain).
MAX_NUM_SEQS_CHOSEN = "--max-num-seqs"

# Keys of override_neuron_config this module interprets; any other key is passed
# through to NxDI's NeuronConfig unchanged.
GRID_KEYS = (
    "context_encoding_buckets",
    "token_generation_buckets",
    "prefix_buckets",
    "token_generation_batches",
)
INTERPRETED_KEYS = frozenset(
    GRID_KEYS
    + (
        "enable_bucketing",
        "is_prefix_caching",
        "is_block_kv_layout",
        "is_chunked_prefill",
        "pa_num_blocks",
        "pa_block_size",
        "skip_warmup",
        "on_device_sampling_config",
        "tp_degree",
        "batch_size",
        "tkg_batch_size",
        "ctx_batch_size",
        "max_context_length",
        "seq_len",
        "torch_dtype",
    )
)


@dataclass(frozen=True)
class EngineUpdate:
    """One value the platform writes back into vLLM's config, and why."""

    section: str  # the VllmConfig attribute: "cache_config", "scheduler_config", ...
    name: str
    value: Any
    reason: str


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

    @property
    def is_block_layout(self) -> bool:
        return self.kv_layout == BLOCK

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
        return [(n, p) for n in self.context_encoding_buckets for p in self.prefix_buckets
                if prefix_caching_need(self.context_encoding_buckets, self.prefix_buckets,
                                       (n, p), self.max_model_len) is not None]

    def token_generation_shapes(self) -> list[tuple[int, int]]:
        """(batch, context length) for every token-generation graph."""
        return [(b, n) for b in self.token_generation_batches
                for n in self.token_generation_buckets]

    def capacity(self) -> str:
        """The KV cache's capacity in one line, the same in the server log and in
        explain-config. vLLM's own "KV cache size" line counts its null block, which
        holds no sequence, so it reads one block more."""
        vllm_tokens = self.num_blocks * self.block_size
        if not self.is_block_layout:
            return (f"{self.max_num_seqs} sequences of up to {self.max_model_len:,} tokens "
                    f"({self.max_num_seqs * self.max_model_len:,} tokens); vLLM's \"KV cache "
                    f"size\" line also counts its null block ({vllm_tokens:,} tokens)")
        usable = self.num_blocks - 1  # never fewer than max_num_seqs full sequences
        return (f"{usable * self.block_size:,} tokens in {usable} blocks of {self.block_size}, "
                f"{self.max_num_seqs} sequences of up to {self.max_model_len:,} tokens at "
                f"once; vLLM's \"KV cache size\" line also counts its null block "
                f"({vllm_tokens:,} tokens)")

    def graph_count(self) -> int:
        return len(self.context_encoding_shapes()) + len(self.token_generation_shapes())

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["passthrough"] = dict(self.passthrough)
        return json.loads(json.dumps(data))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NeuronSettings:
        values = dict(data)
        for key in GRID_KEYS:
            values[key] = tuple(values[key])
        values["rank_cores"] = tuple(tuple(cores) for cores in values.get("rank_cores", ()))
        return cls(**values)


def _error(message: str) -> NeuronConfigError:
    return NeuronConfigError(message)


def _int_setting(override: Mapping[str, Any], key: str) -> int | None:
    value = override.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _error(
            f"override_neuron_config.{key}={value!r} must be a positive integer; "
            f"fix the value or remove the key."
        )
    return value


def _bool_setting(override: Mapping[str, Any], key: str) -> bool | None:
    value = override.get(key)
    if value is not None and not isinstance(value, bool):
        raise _error(
            f"override_neuron_config.{key}={value!r} must be true or false."
        )
    return value


# NxDI features this plugin does not drive: any value but null, false or 0 turns the
# feature on in NxDI (an empty chunked_prefill_config object included) and is rejected.
UNSUPPORTED_KEYS = {
    "chunked_prefill_config": (
        "chunked prefill here runs one request's chunk per context-encoding call on the "
        "block-layout (chunk x prefix) graphs, not NxDI's multi-request chunked-prefill "
        "kernel; --enable-chunked-prefill and --max-num-batched-tokens set it up, so "
        "remove chunked_prefill_config"),
    "allow_input_truncation": (
        "a prompt longer than the largest bucket is rejected with HTTP 400 instead of "
        "being truncated; remove allow_input_truncation"),
    "async_mode": (
        "the plugin reads each step's logits before scheduling the next; remove "
        "async_mode"),
    "speculation_length": "speculative decoding is not supported yet; remove the key",
    "enable_fused_speculation": "speculative decoding is not supported yet; remove the key",
    "enable_eagle_speculation": "speculative decoding is not supported yet; remove the key",
    "is_medusa": "speculative decoding is not supported yet; remove the key",
    "lora_config": "LoRA is not supported yet; merge the adapter or remove lora_config",
}


def _reject_unsupported(limits: EngineLimits, override: Mapping[str, Any]) -> None:
    for key, reason in UNSUPPORTED_KEYS.items():
        if key in override and override[key] not in (None, False, 0):
            raise _error(f"override_neuron_config.{key}={override[key]!r} is not "
                         f"supported: {reason}.")
    if override.get("padding_side", "right") != "right":
        raise _error(
            f"override_neuron_config.padding_side={override['padding_side']!r}: the "
            f"plugin pads inputs on the right (NxDI's default); remove padding_side."
        )
    if override.get("is_continuous_batching") is False and limits.max_num_seqs > 1:
        raise _error(
            f"override_neuron_config.is_continuous_batching=false contradicts "
            f"max_num_seqs={limits.max_num_seqs}: vLLM batches requests continuously; "
            f"remove is_continuous_batching or pass --max-num-seqs 1."
        )
    sampling = override.get("on_device_sampling_config")
    if sampling is not None and not isinstance(sampling, Mapping):
        raise _error(
            f"override_neuron_config.on_device_sampling_config={sampling!r} must be an "
            f"object of NxDI OnDeviceSamplingConfig fields, e.g. {{\"global_topk\": 256}}."
        )


def _refuse_what_cannot_work(limits: EngineLimits, override: Mapping[str, Any],
                             environ: Mapping[str, str], nxdi_version: str | None) -> None:
    """vLLM flags Neuron cannot honour, vllm-neuron variables set in a way that cannot
    work, and override_neuron_config keys NxDI does not know or values of the wrong type:
    every problem at once, before anything else is decided."""
    # pydantic comes with vLLM; the backend runner's environment never resolves settings.
    from neuron_plugin.core.override_schema import override_problems

    problems = (flag_problems(limits.vllm_flags)
                + environment_problems(environ,
                                       enable_chunked_prefill=limits.enable_chunked_prefill)
                + override_problems(override, nxdi_version))
    if problems:
        raise _error(" ".join(problems))


def _context_buckets_fit(override: Mapping[str, Any], limits: EngineLimits) -> None:
    """Without max_context_length the longest prompt is max_model_len: name the limit the
    user set, not NxDI's key they never wrote."""
    buckets = override.get("context_encoding_buckets")
    if "max_context_length" in override or not buckets or max(buckets) <= limits.max_model_len:
        return
    raise _error(
        f"override_neuron_config.context_encoding_buckets={list(buckets)} has "
        f"{max(buckets)}, above max_model_len={limits.max_model_len} (no prompt is longer); "
        f"remove buckets above {limits.max_model_len} or raise --max-model-len."
    )


def _agree(override: Mapping[str, Any], key: str, vllm_name: str, vllm_value: Any) -> None:
    """NxDI keys that duplicate a vLLM setting must match it: vLLM's value wins nowhere
    silently, so a mismatch is an error rather than an overwrite."""
    if key in override and override[key] != vllm_value:
        raise _error(
            f"override_neuron_config.{key}={override[key]!r} contradicts vLLM's "
            f"{vllm_name}={vllm_value!r}; remove the key (the plugin derives it from "
            f"vLLM) or pass --{vllm_name.replace('_', '-')} {override[key]}."
        )


def resolve_kv_layout(limits: EngineLimits, override: Mapping[str, Any]) -> tuple[str, str]:
    """Contiguous unless prefix caching or chunked prefill needs blocks (the findings:
    block layout costs latency, so it is used only when a feature requires it)."""
    block_kv = _bool_setting(override, "is_block_kv_layout")
    for key, vllm_name, value in (
        ("is_prefix_caching", "enable_prefix_caching", limits.enable_prefix_caching),
        ("is_chunked_prefill", "enable_chunked_prefill", limits.enable_chunked_prefill),
    ):
        given = _bool_setting(override, key)
        if given is not None and given != value:
            flag = f"--{'' if given else 'no-'}{vllm_name.replace('_', '-')}"
            raise _error(
                f"override_neuron_config.{key}={given} contradicts vLLM's "
                f"{vllm_name}={value}; pass {flag} or remove {key}."
            )
    needs_blocks = [
        name for name, on in (
            ("prefix caching", limits.enable_prefix_caching),
            ("chunked prefill", limits.enable_chunked_prefill),
        ) if on
    ]
    if needs_blocks:
        if block_kv is False:
            raise _error(
                f"override_neuron_config.is_block_kv_layout=false cannot serve "
                f"{' and '.join(needs_blocks)}, which reads the KV cache through block "
                f"tables; remove is_block_kv_layout or disable "
                f"{' and '.join(needs_blocks)}."
            )
        return BLOCK, f"{' and '.join(needs_blocks)} on"
    if block_kv:
        return BLOCK, "override_neuron_config.is_block_kv_layout=true"
    return CONTIGUOUS, "prefix caching and chunked prefill off"


def required_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks for `max_num_seqs` full-length sequences plus vLLM's null block
    (true ceiling division: a partial last block is still a block)."""
    return max_num_seqs * math.ceil(max_model_len / block_size) + 1


def resolve_blocks(limits: EngineLimits, override: Mapping[str, Any],
                   kv_layout: str) -> tuple[int, int]:
    """(block_size, num_blocks including the null block) for the chosen layout."""
    pa_block_size = _int_setting(override, "pa_block_size")
    pa_num_blocks = _int_setting(override, "pa_num_blocks")
    if kv_layout == CONTIGUOUS:
        for key in ("pa_block_size", "pa_num_blocks"):
            if key in override:
                raise _error(
                    f"override_neuron_config.{key} applies to the block KV layout, but "
                    f"the layout is contiguous (prefix caching and chunked prefill off); "
                    f"remove {key} or enable --enable-prefix-caching."
                )
        # One vLLM block per sequence (block_size = max_model_len) and one per slot.
        return limits.max_model_len, limits.max_num_seqs + 1

    block_size = limits.block_size or DEFAULT_BLOCK_SIZE
    if pa_block_size is not None and pa_block_size != block_size:
        raise _error(
            f"override_neuron_config.pa_block_size={pa_block_size} differs from vLLM's "
            f"block_size={block_size}; pass --block-size {pa_block_size} or remove "
            f"pa_block_size (it follows --block-size)."
        )
    override_blocks = limits.num_gpu_blocks_override
    if (pa_num_blocks is not None and override_blocks is not None
            and pa_num_blocks != override_blocks):
        raise _error(
            f"override_neuron_config.pa_num_blocks={pa_num_blocks} differs from vLLM's "
            f"num_gpu_blocks_override={override_blocks}; both count the same blocks "
            f"(including vLLM's null block), so set one of them."
        )
    needed = required_blocks(limits.max_num_seqs, limits.max_model_len, block_size)
    given = pa_num_blocks if pa_num_blocks is not None else override_blocks
    if given is None:
        return block_size, needed
    if given < needed:
        per_seq = math.ceil(limits.max_model_len / block_size)
        name = "pa_num_blocks" if pa_num_blocks is not None else "num_gpu_blocks_override"
        raise _error(
            f"{name}={given} is too small: max_num_seqs={limits.max_num_seqs} sequences "
            f"of max_model_len={limits.max_model_len} tokens need "
            f"{limits.max_num_seqs} x ceil({limits.max_model_len}/{block_size})="
            f"{limits.max_num_seqs * per_seq} blocks plus vLLM's null block = {needed}; "
            f"set {name} >= {needed} or lower max_num_seqs / max_model_len."
        )
    return block_size, given


def _grid(override: Mapping[str, Any], key: str, default: list[int], *, maximum: int,
          limit_name: str, covers: int | None = None, why: str = "",
          align: int | None = None) -> tuple[int, ...]:
    """A user grid validated against its limit (named in the message), with `covers`
    against the largest need it must serve (`why` says whose need) and with `align`
    against the KV block size."""
    if key not in override:
        return tuple(default)
    try:
        return validate_grid(override[key], name=f"override_neuron_config.{key}",
                             maximum=maximum, covers=covers, limit_name=limit_name,
                             align=align)
    except BucketError as exc:
        raise _error(f"{exc} ({why})" if why else str(exc)) from None


def resolve_grids(limits: EngineLimits, override: Mapping[str, Any], kv_layout: str,
                  max_context_length: int, *, block_size: int) -> dict[str, tuple[int, ...]]:
    """Bucket grids: NxDI's powers of two by default (so existing configurations keep
    their meaning), the user's lists when given, one full-size graph when bucketing is
    off.

    In the block layout every token-generation and prefix bucket is a whole number of
    KV blocks: NxDI hands a graph of length L the first L // pa_block_size blocks of the
    block table (model_wrapper._pad_prefix_caching_inputs), so the positions of a partial
    last block would never be attended. Defaults are rounded up to whole blocks (the
    largest to max_model_len rounded up; the nxd backend raises NxDI's seq_len to it),
    user lists must already be whole blocks. `block_size` is resolve_blocks' choice."""
    enable = _bool_setting(override, "enable_bucketing")
    enable = True if enable is None else enable
    seq = limits.max_model_len
    batch = limits.max_num_seqs
    block = kv_layout == BLOCK
    unit = block_size if block else 1
    reach = -(-seq // unit) * unit
    reach_name = (f"max_model_len rounded up to whole {unit}-token KV blocks" if block
                  else "max_model_len")
    if not enable:
        given = [key for key in GRID_KEYS if key in override]
        if given:
            raise _error(
                f"override_neuron_config.enable_bucketing=false but {', '.join(given)} "
                f"given; remove the bucket lists or set enable_bucketing=true."
            )
        return {
            "context_encoding_buckets": (max_context_length,),
            "token_generation_buckets": (reach,),
            "prefix_buckets": (0, reach) if block else (),
            "token_generation_batches": (batch,),
        }
    ctx_default = nxdi_buckets(min(MIN_BUCKET, max_context_length), max_context_length)
    tkg_default = align_up(nxdi_buckets(min(MIN_BUCKET, seq), seq), unit)
    grids = {
        # With chunked prefill a chunk of up to max_num_batched_tokens must fit one graph.
        "context_encoding_buckets": _grid(
            override, "context_encoding_buckets", ctx_default, maximum=max_context_length,
            limit_name="max_context_length",
            covers=min(limits.max_num_batched_tokens, max_context_length)
            if limits.enable_chunked_prefill else None,
            why=(f"a chunk of max_num_batched_tokens={limits.max_num_batched_tokens} "
                 f"must fit one graph" if limits.enable_chunked_prefill else "")),
        # Decoding walks every position up to max_model_len, so the largest
        # token-generation bucket must reach it or a long request would fail mid-way.
        "token_generation_buckets": _grid(
            override, "token_generation_buckets", tkg_default, maximum=reach,
            limit_name=reach_name, covers=seq, align=unit if block else None,
            why=f"decoding reaches max_model_len={seq}"
                + (f"; NxDI reads whole blocks of block_size={unit}" if block else "")),
        "token_generation_batches": _grid(
            override, "token_generation_batches", [batch], maximum=batch,
            limit_name="max_num_seqs", covers=batch,
            why=f"max_num_seqs={batch} requests can decode together"),
    }
    if block:
        if "prefix_buckets" in override:
            values = list(override["prefix_buckets"] or [])
            # A cached prefix or earlier chunks can reach max_model_len - 1 tokens.
            prefix = _grid({"prefix_buckets": [v for v in values if v != 0]},
                           "prefix_buckets", [], maximum=reach, limit_name=reach_name,
                           covers=seq - 1, align=unit,
                           why=f"a cached prefix can reach max_model_len - 1 = {seq - 1}; "
                               f"NxDI reads whole blocks of block_size={unit}")
            grids["prefix_buckets"] = (0,) + prefix
        else:
            grids["prefix_buckets"] = (0,) + tuple(tkg_default)
    elif "prefix_buckets" in override:
        raise _error(
            "override_neuron_config.prefix_buckets applies to the block KV layout, but "
            "prefix caching and chunked prefill are off; remove prefix_buckets or pass "
            "--enable-prefix-caching."
        )
    else:
        grids["prefix_buckets"] = ()
    return grids


def resolve_on_device_sampling(override: Mapping[str, Any],
                               disabled_env: str | None) -> tuple[bool, int]:
    """(on, global_topk): on by default as in vllm-neuron; off with
    `on_device_sampling_config: null` or NEURON_ON_DEVICE_SAMPLING_DISABLED set to a
    non-zero integer (`disabled_env` is that variable's value, read by the caller)."""
    text = (disabled_env or "").strip()
    try:
        disabled = bool(text) and int(text) != 0
    except ValueError:
        raise _error(
            f"{DISABLED_ENV}={disabled_env!r} is not an integer; set it to 1 to sample on "
            f"the host, or 0 (or unset it) for on-device sampling.") from None
    config = override.get("on_device_sampling_config", {})
    topk = (config or {}).get("global_topk", DEFAULT_GLOBAL_TOPK)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise _error(
            f"override_neuron_config.on_device_sampling_config.global_topk={topk!r} must "
            f"be a positive integer (default {DEFAULT_GLOBAL_TOPK}); fix or remove it.")
    return not disabled and config is not None, topk


def resolve_max_num_seqs(limits: EngineLimits, override: Mapping[str, Any], backend: str,
                         budget: SequenceBudget | None) -> tuple[int, str]:
    """(sequence slots, why). A value the user chose is kept; vLLM's GPU-sized default
    becomes vllm-neuron's `batch_size` if given, else NEURON_DEFAULT_MAX_NUM_SEQS, fewer
    where the nxd backend's device memory holds fewer full-length sequences."""
    if not limits.max_num_seqs_is_default:
        return limits.max_num_seqs, MAX_NUM_SEQS_CHOSEN
    for key in ("batch_size", "tkg_batch_size"):
        given = _int_setting(override, key)
        if given:
            return given, (f"override_neuron_config.{key}={given}, with --max-num-seqs "
                           f"left at vLLM's default")
    seqs = min(limits.max_num_seqs, NEURON_DEFAULT_MAX_NUM_SEQS)
    reason = (f"vLLM's default of {limits.max_num_seqs} is sized for GPUs; on Neuron every "
              f"sequence slot is compiled into the graphs and holds max_model_len positions "
              f"of KV cache, so {seqs}, as in vllm-neuron; --max-num-seqs sets another value")
    fits = budget.sequences(limits.max_model_len) if budget and backend == "nxd" else None
    if fits is not None and fits < seqs:
        seqs = 1 << (fits.bit_length() - 1) if fits else 1
        reason = (f"vLLM's default of {limits.max_num_seqs} is sized for GPUs; {fits} "
                  f"sequences of {limits.max_model_len} tokens fit in the "
                  f"{budget.describe()} the weights leave, so {seqs}; --max-num-seqs sets "
                  f"another value")
    return seqs, reason


def resolve_settings(limits: EngineLimits, override: Mapping[str, Any] | None, *,
                     backend: str, architecture: str,
                     backend_python: str | None = None,
                     on_device_sampling_disabled: str | None = None,
                     environ: Mapping[str, str] | None = None,
                     nxdi_version: str | None = None,
                     visible_cores: Sequence[int] | None = None,
                     cores_source: str = "",
                     budget: SequenceBudget | None = None) -> NeuronSettings:
    """The single place where a configuration is decided (see the module docstring).
    `environ` holds the vllm-neuron variables the caller read
    (core.vllm_neuron_env.NAMES); `nxdi_version` is the NxDI installed where the nxd
    backend runs, None when unknown; `visible_cores` are the NeuronCore ids this host
    lets the engines use (`cores_source` says where they come from), None where none
    are visible; `budget` is the device memory an engine has for KV cache, None when
    unknown."""
    override = dict(override or {})
    if backend not in BACKENDS:
        raise _error(
            f"backend {backend!r} is not known; set VLLM_NEURON_BACKEND to one of "
            f"{', '.join(BACKENDS)}."
        )
    max_num_seqs, max_num_seqs_reason = resolve_max_num_seqs(limits, override, backend,
                                                             budget)
    limits = dataclasses.replace(limits, max_num_seqs=max_num_seqs)
    _refuse_what_cannot_work(limits, override, environ or {},
                             nxdi_version if backend == "nxd" else None)
    _agree(override, "tp_degree", "tensor_parallel_size", limits.tp_degree)
    _agree(override, "batch_size", "max_num_seqs", limits.max_num_seqs)
    _agree(override, "tkg_batch_size", "max_num_seqs", limits.max_num_seqs)
    _agree(override, "seq_len", "max_model_len", limits.max_model_len)
    _agree(override, "torch_dtype", "dtype", limits.dtype)
    ctx_batch = _int_setting(override, "ctx_batch_size") or 1
    if ctx_batch != 1:
        raise _error(
            f"override_neuron_config.ctx_batch_size={ctx_batch} is not supported: this "
            f"plugin encodes one new prompt per context-encoding call; remove the key."
        )
    max_context = _int_setting(override, "max_context_length") or limits.max_model_len
    if max_context > limits.max_model_len:
        raise _error(
            f"override_neuron_config.max_context_length={max_context} exceeds "
            f"max_model_len={limits.max_model_len}; lower it or raise --max-model-len."
        )
    _context_buckets_fit(override, limits)
    if backend == "reference" and limits.tp_degree != 1:
        raise _error(
            f"tensor_parallel_size={limits.tp_degree} needs NeuronCores; the reference "
            f"backend runs on one CPU process: use --tensor-parallel-size 1 or "
            f"VLLM_NEURON_BACKEND=nxd on a Neuron host."
        )
    _reject_unsupported(limits, override)
    kv_layout, reason = resolve_kv_layout(limits, override)
    block_size, num_blocks = resolve_blocks(limits, override, kv_layout)
    grids = resolve_grids(limits, override, kv_layout, max_context, block_size=block_size)
    if (backend == "nxd" and kv_layout == BLOCK
            and grids["token_generation_batches"] != (limits.max_num_seqs,)):
        raise _error(
            f"override_neuron_config.token_generation_batches="
            f"{list(grids['token_generation_batches'])} needs the contiguous KV layout: "
            f"NxDI does not batch-bucket the block layout ({reason}); remove "
            f"token_generation_batches or turn off prefix caching and chunked prefill."
        )
    on_device, global_topk = resolve_on_device_sampling(override, on_device_sampling_disabled)
    # Refused here, with the arithmetic, rather than when the last engine starts.
    rank_cores = () if visible_cores is None else tuple(
        tuple(cores) for cores in core_slices(limits.tp_degree, limits.dp_degree,
                                              visible_cores, cores_source))
    passthrough = {k: v for k, v in override.items() if k not in INTERPRETED_KEYS}
    if on_device and override.get("on_device_sampling_config"):
        # The nxd backend completes it (backends/nxd.py); never passed when off.
        passthrough["on_device_sampling_config"] = override["on_device_sampling_config"]
    return NeuronSettings(
        backend=backend,
        architecture=architecture,
        dtype=limits.dtype,
        tp_degree=limits.tp_degree,
        max_model_len=limits.max_model_len,
        max_context_length=max_context,
        max_num_seqs=limits.max_num_seqs,
        ctx_batch_size=ctx_batch,
        enable_bucketing=override.get("enable_bucketing", True),
        context_encoding_buckets=grids["context_encoding_buckets"],
        prefix_buckets=grids["prefix_buckets"],
        token_generation_buckets=grids["token_generation_buckets"],
        token_generation_batches=grids["token_generation_batches"],
        kv_layout=kv_layout,
        kv_layout_reason=reason,
        block_size=block_size,
        num_blocks=num_blocks,
        is_prefix_caching=limits.enable_prefix_caching,
        is_chunked_prefill=limits.enable_chunked_prefill,
        on_device_sampling=on_device,
        global_topk=global_topk,
        skip_warmup=bool(override.get("skip_warmup", False)),
        passthrough=passthrough,
        backend_python=backend_python or None,
        dp_degree=limits.dp_degree,
        rank_cores=rank_cores,
        max_num_seqs_reason=max_num_seqs_reason,
    )



def engine_updates(settings: NeuronSettings) -> tuple[EngineUpdate, ...]:
    """What vLLM's scheduler must know of the resolved settings: the KV geometry the
    graphs are compiled for, synchronous steps, and the Neuron worker."""
    if settings.is_block_layout:
        block_reason = (f"block KV layout ({settings.kv_layout_reason}); "
                        f"{DEFAULT_BLOCK_SIZE} unless --block-size is given")
    else:
        block_reason = ("contiguous KV layout: one block per sequence "
                        "(block_size = max_model_len)")
    updates = [
        EngineUpdate("scheduler_config", "max_num_seqs", settings.max_num_seqs,
                     settings.max_num_seqs_reason),
        EngineUpdate("cache_config", "block_size", settings.block_size, block_reason),
        EngineUpdate(
            "cache_config", "num_gpu_blocks_override", settings.num_blocks,
            f"{settings.kv_layout} KV layout needs exactly the block count the graphs are "
            f"compiled for (NxDI pa_num_blocks, including vLLM's null block)"),
        EngineUpdate("scheduler_config", "async_scheduling", False,
                     "host sampling needs each step's logits before the next step"),
        EngineUpdate("parallel_config", "worker_cls", WORKER_CLS,
                     "the Neuron worker drives the backend"),
    ]
    if settings.tp_degree > 1:
        updates.append(EngineUpdate("parallel_config", "distributed_executor_backend",
                                    "uni", "NxDI shards across NeuronCores inside one "
                                           "process"))
    return tuple(updates)
