"""vLLM's settings + `override_neuron_config` -> one resolved, frozen `NeuronSettings`.

Everything a backend needs is decided here, once, before anything compiles: the KV
layout and why, block size and count (vLLM's count includes its null block and equals
NxDI's `pa_num_blocks`), every bucket grid, and (`engine_updates`) which of these vLLM's
scheduler must be told. Users of vllm-neuron already write
`override_neuron_config` keys; they keep their meaning. Contradictions raise
`NeuronConfigError` naming both settings and the fix. This module is pure: no vLLM or
NxDI imports, so it is unit-tested over plain values.

It puts the decisions in order; each concern has its module: `neuron_settings` (the
values), `override_checks` (one key at a time), `kv_layout` (layout, block size and
count), `bucket_grids`. The names callers use are importable from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from neuron_plugin import BACKENDS
from neuron_plugin.core.bucket_grids import (
    BATCH_LIMIT_KEY,
    LOGITS_KEY,
    largest_batch_bucket,
    logits_note,
    resolve_grids,
)
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.instances import core_slices
from neuron_plugin.core.kv_layout import (
    DEFAULT_BLOCK_SIZE,
    required_blocks,
    resolve_blocks,
    resolve_kv_layout,
)
from neuron_plugin.core.kv_transfer import kv_transfer_problems
from neuron_plugin.core.lora import resolve_lora
from neuron_plugin.core.memory import SequenceBudget
from neuron_plugin.core.neuron_settings import (
    BLOCK,
    CONTIGUOUS,
    FUSED_METHODS,
    GRID_KEYS,
    MAX_NUM_SEQS_CHOSEN,
    EngineLimits,
    EngineUpdate,
    NeuronSettings,
)
from neuron_plugin.core.nxdi_cpu_mode import refuse_what_the_cpu_mode_cannot_run
from neuron_plugin.core.override_checks import (
    UNSUPPORTED_KEYS,
    agree,
    context_buckets_fit,
    int_setting,
    refuse_what_cannot_work,
    reject_unsupported,
)
from neuron_plugin.core.prompt_logprobs import (
    PROMPT_LOGPROBS_KEY,
    refuse_last_token_only,
    resolve_prompt_logprobs,
)
from neuron_plugin.core.quantization import Quantization
from neuron_plugin.core.sampling import (
    DEFAULT_GLOBAL_TOPK,
    DISABLED_ENV,
    default_request_refusal,
    resolve_exact_sampling,
)
from neuron_plugin.core.speculation import resolve_speculation
from neuron_plugin.core.vision import VISION_BUCKETS_KEY, resolve_vision_buckets
from neuron_plugin.core.vllm_flags import WORKER_CLS

# The names callers import from here, wherever they are defined.
__all__ = [
    "BLOCK",
    "CONTIGUOUS",
    "GRID_KEYS",
    "INTERPRETED_KEYS",
    "MAX_NUM_SEQS_CHOSEN",
    "NEURON_DEFAULT_MAX_NUM_SEQS",
    "UNSUPPORTED_KEYS",
    "EngineLimits",
    "EngineUpdate",
    "NeuronConfigError",
    "NeuronSettings",
    "engine_updates",
    "required_blocks",
    "resolve_max_num_seqs",
    "resolve_on_device_sampling",
    "resolve_settings",
]

# Sequence slots when the user leaves vLLM's GPU-sized default (vllm-neuron 0.x's default).
NEURON_DEFAULT_MAX_NUM_SEQS = 32

# Keys of override_neuron_config this package interprets; any other key is passed
# through to NxDI's NeuronConfig unchanged.
INTERPRETED_KEYS = frozenset(
    (
        *GRID_KEYS,
        LOGITS_KEY,
        BATCH_LIMIT_KEY,
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
        "lora_config",
        VISION_BUCKETS_KEY,
    )
)


def resolve_on_device_sampling(
    override: Mapping[str, Any], disabled_env: str | None
) -> tuple[bool, int]:
    """(on, global_topk): on by default as in vllm-neuron; off with
    `on_device_sampling_config: null` or NEURON_ON_DEVICE_SAMPLING_DISABLED set to a
    non-zero integer (`disabled_env` is that variable's value, read by the caller)."""
    text = (disabled_env or "").strip()
    try:
        disabled = bool(text) and int(text) != 0
    except ValueError:
        raise NeuronConfigError(
            f"{DISABLED_ENV}={disabled_env!r} is not an integer; set it to 1 to sample on "
            f"the host, or 0 (or unset it) for on-device sampling."
        ) from None
    config = override.get("on_device_sampling_config", {})
    topk = (config or {}).get("global_topk", DEFAULT_GLOBAL_TOPK)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise NeuronConfigError(
            f"override_neuron_config.on_device_sampling_config.global_topk={topk!r} must "
            f"be a positive integer (default {DEFAULT_GLOBAL_TOPK}); fix or remove it."
        )
    return not disabled and config is not None, topk


def resolve_max_num_seqs(
    limits: EngineLimits, override: Mapping[str, Any], backend: str, budget: SequenceBudget | None
) -> tuple[int, str]:
    """(sequence slots, why). A value the user chose is kept; vLLM's GPU-sized default
    becomes vllm-neuron's `batch_size` if given, else the largest decode batch bucket
    (`token_generation_batches`, as given or from a bucket set) if given, else
    NEURON_DEFAULT_MAX_NUM_SEQS, fewer where the nxd backend's device memory holds fewer
    full-length sequences. (An explicit `max_num_seqs=128` in `LLM(...)` reads as vLLM's
    default: the batch buckets then say how many sequences the user means.)"""
    if not limits.max_num_seqs_is_default:
        return limits.max_num_seqs, MAX_NUM_SEQS_CHOSEN
    for key in ("batch_size", "tkg_batch_size"):
        given = int_setting(override, key)
        if given:
            return given, (
                f"override_neuron_config.{key}={given}, with --max-num-seqs left at vLLM's default"
            )
    top = largest_batch_bucket(override)
    if top is not None:
        return top, (
            f"override_neuron_config.token_generation_batches tops out at {top}, with "
            f"--max-num-seqs left at vLLM's default"
        )
    seqs = min(limits.max_num_seqs, NEURON_DEFAULT_MAX_NUM_SEQS)
    reason = (
        f"vLLM's default of {limits.max_num_seqs} is sized for GPUs; on Neuron every "
        f"sequence slot is compiled into the graphs and holds max_model_len positions "
        f"of KV cache, so {seqs}, as in vllm-neuron; --max-num-seqs sets another value"
    )
    if budget is None or backend != "nxd":
        return seqs, reason
    fits = budget.sequences(limits.max_model_len)
    if fits < seqs:
        seqs = 1 << (fits.bit_length() - 1) if fits else 1
        reason = (
            f"vLLM's default of {limits.max_num_seqs} is sized for GPUs; {fits} "
            f"sequences of {limits.max_model_len} tokens fit in the "
            f"{budget.describe()} the weights leave, so {seqs}; --max-num-seqs sets "
            f"another value"
        )
    return seqs, reason


def one_batch_reason(
    backend: str,
    kv_layout: str,
    layout_reason: str,
    speculation_method: str | None,
    max_loras: int,
    nxdi_version: str | None,
    opted_in: bool = False,
) -> str | None:
    """Why this configuration decodes in one batch size (max_num_seqs) by default, or
    None where it gets decode batch buckets (core.bucket_grids.default_batches). The
    reference backend batch-buckets every configuration; NxDI only the contiguous layout
    without speculation or LoRA, from 0.8 (models/config.py
    _validate_batch_bucketing_compatibility; token_generation_batches is a 0.8 key).
    Where the NxDI release is unknown it decodes in one size unless `opted_in` (the
    user set max_batch_buckets); 0.7 would refuse the key at load, naming the fix."""
    if backend != "nxd":
        return None
    if kv_layout == BLOCK:
        return f"NxDI does not batch-bucket the block KV layout, chosen for {layout_reason}"
    if speculation_method:
        return (
            "NxDI refuses batch bucketing with speculative decoding (models/config.py "
            "_validate_batch_bucketing_compatibility)"
        )
    if max_loras:
        return "NxDI's LoRA weight_active holds one row per sequence of the full batch"
    if nxdi_version is not None and nxdi_version.startswith("0.7."):
        return f"NxDI {nxdi_version} has no batch bucketing (token_generation_batches is 0.8+)"
    if nxdi_version is None and not opted_in:
        return (
            f"the NxDI release is unknown here, and 0.7 has no batch bucketing; "
            f"{BATCH_LIMIT_KEY} (e.g. 6) asks for decode batch buckets with NxDI 0.8+"
        )
    return None


def resolve_settings(
    limits: EngineLimits,
    override: Mapping[str, Any] | None,
    *,
    backend: str,
    architecture: str,
    backend_python: str | None = None,
    on_device_sampling_disabled: str | None = None,
    exact_sampling: object = None,
    prompt_logprobs: object = None,
    environ: Mapping[str, str] | None = None,
    nxdi_version: str | None = None,
    visible_cores: Sequence[int] | None = None,
    cores_source: str = "",
    budget: SequenceBudget | None = None,
) -> NeuronSettings:
    """The single place where a configuration is decided (see the module docstring).
    `environ` holds the vllm-neuron variables the caller read
    (core.vllm_neuron_env.NAMES); `nxdi_version` is the NxDI installed where the nxd
    backend runs, None when unknown; `visible_cores` are the NeuronCore ids this host
    lets the engines use (`cores_source` says where they come from), None where none
    are visible; `budget` is the device memory an engine has for KV cache, None when
    unknown; `exact_sampling` and `prompt_logprobs` are `additional_config`'s keys as
    given."""
    override = dict(override or {})
    if backend not in BACKENDS:
        raise NeuronConfigError(
            f"backend {backend!r} is not known; set VLLM_NEURON_BACKEND to one of "
            f"{', '.join(BACKENDS)}."
        )
    max_num_seqs, max_num_seqs_reason = resolve_max_num_seqs(limits, override, backend, budget)
    limits = dataclasses.replace(limits, max_num_seqs=max_num_seqs)
    refuse_what_cannot_work(
        limits, override, environ or {}, nxdi_version if backend == "nxd" else None, architecture
    )
    agree(override, "tp_degree", "tensor_parallel_size", limits.tp_degree)
    agree(override, "batch_size", "max_num_seqs", limits.max_num_seqs)
    agree(override, "tkg_batch_size", "max_num_seqs", limits.max_num_seqs)
    agree(override, "seq_len", "max_model_len", limits.max_model_len)
    agree(override, "torch_dtype", "dtype", limits.dtype)
    ctx_batch = int_setting(override, "ctx_batch_size") or 1
    if ctx_batch != 1:
        raise NeuronConfigError(
            f"override_neuron_config.ctx_batch_size={ctx_batch} is not supported: this "
            f"plugin encodes one new prompt per context-encoding call; remove the key."
        )
    max_context = int_setting(override, "max_context_length") or limits.max_model_len
    if max_context > limits.max_model_len:
        raise NeuronConfigError(
            f"override_neuron_config.max_context_length={max_context} exceeds "
            f"max_model_len={limits.max_model_len}; lower it or raise --max-model-len."
        )
    context_buckets_fit(override, limits)
    if backend == "reference" and limits.tp_degree != 1:
        raise NeuronConfigError(
            f"tensor_parallel_size={limits.tp_degree} needs NeuronCores; the reference "
            f"backend runs on one CPU process: use --tensor-parallel-size 1 or "
            f"VLLM_NEURON_BACKEND=nxd on a Neuron host."
        )
    reject_unsupported(limits, override)
    kv_layout, reason = resolve_kv_layout(limits, override)
    block_size, num_blocks = resolve_blocks(limits, override, kv_layout)
    on_device, global_topk = resolve_on_device_sampling(override, on_device_sampling_disabled)
    batches = override.get("token_generation_batches") or []
    method, drafts, draft_model = resolve_speculation(
        limits,
        backend=backend,
        kv_layout=kv_layout,
        on_device_sampling=on_device,
        batch_bucketing=bool(batches) and list(batches) != [limits.max_num_seqs],
    )
    transfer_problems = kv_transfer_problems(limits.kv_transfer, kv_layout, reason, draft_model)
    if transfer_problems:
        raise NeuronConfigError(" ".join(transfer_problems))
    exact = resolve_exact_sampling(exact_sampling)
    # Where a decode with a host-sampled row runs a logits twin (nxd, on-device sampling,
    # no fused drafter: NeuronSettings.token_generation_logits_shapes), whether a request
    # that sets no sampling parameters is one.
    twins = backend == "nxd" and on_device and method not in FUSED_METHODS
    host_default = (
        default_request_refusal(limits.default_sampling, global_topk, exact) if twins else None
    )
    batches_reason = one_batch_reason(
        backend,
        kv_layout,
        reason,
        method,
        limits.max_loras,
        nxdi_version,
        opted_in=BATCH_LIMIT_KEY in override or "token_generation_batches" in override,
    )
    grids = resolve_grids(
        limits,
        override,
        kv_layout,
        max_context,
        block_size=block_size,
        speculation_length=drafts + 1 if method else 0,
        host_default=host_default,
        one_batch_reason=batches_reason,
    )
    if (
        backend == "nxd"
        and kv_layout == BLOCK
        and grids["token_generation_batches"] != (limits.max_num_seqs,)
    ):
        raise NeuronConfigError(
            f"override_neuron_config.token_generation_batches="
            f"{list(grids['token_generation_batches'])} needs the contiguous KV layout: "
            f"NxDI does not batch-bucket the block layout ({reason}); remove "
            f"token_generation_batches or turn off prefix caching and chunked prefill."
        )
    if LOGITS_KEY in override and method in FUSED_METHODS:
        raise NeuronConfigError(
            f"override_neuron_config.{LOGITS_KEY} chooses token-generation graphs with "
            f"logits beside tokens-only ones, but a fused draft model's or EAGLE head's "
            f"graphs return no "
            f"logits (requests that need them are refused); remove {LOGITS_KEY}."
        )
    if LOGITS_KEY in override and not on_device:
        raise NeuronConfigError(
            f"override_neuron_config.{LOGITS_KEY} chooses the token-generation graphs "
            f"compiled with logits beside tokens-only ones, which exist with on-device "
            f"sampling only, and it is off (every graph returns logits); remove "
            f"{LOGITS_KEY}."
        )
    lora = resolve_lora(limits, override, backend=backend)
    quantization = Quantization.from_override(override)
    if quantization is not None and backend == "reference" and quantization.dtype != "int8":
        raise NeuronConfigError(
            f"override_neuron_config.quantization_dtype={quantization.dtype!r}: the reference "
            f"backend serves int8 weight quantization; use quantization_dtype int8 there "
            f"(fp8 runs on the nxd backend)."
        )
    prompt_k = resolve_prompt_logprobs(prompt_logprobs, limits.max_logprobs, limits.logprobs_mode)
    if prompt_k is not None and draft_model:
        raise NeuronConfigError(
            f"additional_config.{PROMPT_LOGPROBS_KEY}=true with a draft model or EAGLE "
            f"head ({draft_model}): the prompt-logprob graphs encode the target alone, not "
            f"the draft's state; serve prompt logprobs without --speculative-config, or with "
            f"n-gram speculation."
        )
    if prompt_k is not None and limits.vision is not None:
        raise NeuronConfigError(
            f"additional_config.{PROMPT_LOGPROBS_KEY}=true with a vision-language model: "
            f"the prompt-logprob graphs take no image embeddings; drop "
            f"{PROMPT_LOGPROBS_KEY} for this model."
        )
    if backend == "nxd" and limits.vision is not None and LOGITS_KEY in override:
        raise NeuronConfigError(
            f"override_neuron_config.{LOGITS_KEY}={override[LOGITS_KEY]!r} with a "
            f"vision-language model: every decode graph of NxDI's image-to-text "
            f"application returns its logits (its text wrappers trace their own two "
            f"submodels only, so no logits-free twin is built); remove {LOGITS_KEY}."
        )
    if prompt_k is not None and backend == "nxd":
        refuse_last_token_only(override)
    if limits.state is not None:
        _refuse_for_state_layers(limits, method, prompt_k)
    # Refused here, with the arithmetic, rather than when the last engine starts.
    rank_cores = (
        ()
        if visible_cores is None
        else tuple(
            tuple(cores)
            for cores in core_slices(
                limits.tp_degree, limits.dp_degree, visible_cores, cores_source
            )
        )
    )
    passthrough = {k: v for k, v in override.items() if k not in INTERPRETED_KEYS}
    if on_device and override.get("on_device_sampling_config"):
        # The nxd backend completes it (backends/nxd.py); never passed when off.
        passthrough["on_device_sampling_config"] = override["on_device_sampling_config"]
    settings = NeuronSettings(
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
        token_generation_batches_reason=batches_reason or "",
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
        exact_sampling=exact,
        prompt_logprobs=prompt_k,
        speculation_method=method,
        num_speculative_tokens=drafts,
        draft_model=draft_model,
        token_generation_logits_buckets=grids[LOGITS_KEY],
        logits_buckets_note=logits_note(
            override, grids[LOGITS_KEY], grids["token_generation_buckets"], host_default
        ),
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
        lora_target_modules=lora.target_modules,
        max_cpu_loras=lora.max_cpu_loras,
        lora_options=dict(lora.nxd_options or {}),
        vision_buckets=resolve_vision_buckets(override, limits.vision),
        state_layers=len(limits.state.layers) if limits.state else 0,
        state_groups=limits.state.groups() if limits.state else 0,
    )
    if backend == "nxd":
        refuse_what_the_cpu_mode_cannot_run(settings)
    return settings


def _refuse_for_state_layers(
    limits: EngineLimits, method: str | None, prompt_k: int | None
) -> None:
    """What a hybrid model's per-sequence state (core.recurrent_state) does not serve
    yet, refused by flag: a speculative step computes positions past those it keeps,
    and the state cannot be rolled back to the accepted ones; a KV connector moves KV
    blocks, not the state; the prompt-logprob graphs take no state."""
    arch = "a model with gated DeltaNet (state) layers"
    if method:
        raise NeuronConfigError(
            f"--speculative-config (method {method}) with {arch}: a speculative step "
            f"writes the per-sequence state past the drafts it rejects, which the state "
            f"cannot take back; remove --speculative-config."
        )
    if limits.kv_transfer is not None:
        raise NeuronConfigError(
            f"--kv-transfer-config with {arch}: the KV connector moves KV blocks, not "
            f"the per-sequence state of those layers; serve it without disaggregation."
        )
    if prompt_k is not None:
        raise NeuronConfigError(
            f"additional_config.{PROMPT_LOGPROBS_KEY}=true with {arch}: the "
            f"prompt-logprob graphs take no per-sequence state; drop {PROMPT_LOGPROBS_KEY}."
        )


def engine_updates(settings: NeuronSettings) -> tuple[EngineUpdate, ...]:
    """What vLLM's scheduler must know of the resolved settings: the KV geometry the
    graphs are compiled for, synchronous steps where every step needs its logits on the
    host (on-device sampling off; otherwise vLLM's async scheduling stays as vLLM
    resolved it: on unless --no-async-scheduling), and the Neuron worker."""
    if settings.is_block_layout:
        block_reason = (
            f"block KV layout ({settings.kv_layout_reason}); "
            f"{DEFAULT_BLOCK_SIZE} unless --block-size is given"
        )
    else:
        block_reason = "contiguous KV layout: one block per sequence (block_size = max_model_len)"
    updates = [
        EngineUpdate(
            "scheduler_config", "max_num_seqs", settings.max_num_seqs, settings.max_num_seqs_reason
        ),
        EngineUpdate("cache_config", "block_size", settings.block_size, block_reason),
        EngineUpdate(
            "cache_config",
            "num_gpu_blocks_override",
            settings.num_blocks,
            f"{settings.kv_layout} KV layout needs exactly the block count the graphs are "
            f"compiled for (NxDI pa_num_blocks, including vLLM's null block)",
        ),
        EngineUpdate(
            "parallel_config", "worker_cls", WORKER_CLS, "the Neuron worker drives the backend"
        ),
    ]
    if settings.state_layers and settings.is_block_layout:
        updates.append(
            EngineUpdate(
                "cache_config",
                "mamba_block_size",
                settings.state_block_size,
                "a hybrid model's state blocks: one per block of positions with prefix "
                "caching (vLLM's 'align' mode), else one per sequence (max_model_len)",
            )
        )
    if not settings.on_device_sampling:
        updates.append(
            EngineUpdate(
                "scheduler_config",
                "async_scheduling",
                False,
                "on-device sampling is off: every step's logits are sampled on the host "
                "before the next step can be scheduled",
            )
        )
    if settings.speculation_method:
        updates.append(
            EngineUpdate(
                "scheduler_config",
                "async_scheduling",
                False,
                "speculative decoding: a step's inputs start after the tokens the previous "
                "step accepted, known only once that step completes",
            )
        )
    if settings.tp_degree > 1:
        updates.append(
            EngineUpdate(
                "parallel_config",
                "distributed_executor_backend",
                "uni",
                "NxDI shards across NeuronCores inside one process",
            )
        )
    return tuple(updates)
