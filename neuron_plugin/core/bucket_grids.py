"""The bucket grids of a configuration: NxDI's defaults, or the user's lists checked
against the limits they must serve."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bucketing.errors import BucketError
from bucketing.grids import align_up, nxdi_buckets, validate_grid
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import BLOCK, GRID_KEYS, EngineLimits
from neuron_plugin.core.override_checks import bool_setting

MIN_BUCKET = 128
LOGITS_KEY = "token_generation_logits_buckets"
# override_neuron_config key: how many decode batch sizes the default grid may hold.
BATCH_LIMIT_KEY = "max_batch_buckets"
DEFAULT_MAX_BATCH_BUCKETS = 6


def default_batches(max_num_seqs: int, limit: int = DEFAULT_MAX_BATCH_BUCKETS) -> list[int]:
    """The default decode batch sizes: the powers of two below max_num_seqs, then
    max_num_seqs (32 -> [1, 2, 4, 8, 16, 32]; 24 -> [1, 2, 4, 8, 16, 24]), so a decode
    step computes fewer than twice its rows. Past `limit` sizes the list is thinned
    evenly on the log scale, keeping 1 and max_num_seqs (256 with limit 6 -> [1, 4, 8,
    32, 64, 256]); limit 1 is [max_num_seqs], one decode batch size."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    sizes.append(max_num_seqs)
    if len(sizes) <= limit:
        return sizes
    if limit == 1:
        return [max_num_seqs]
    last = len(sizes) - 1
    picks = sorted({(i * last + (limit - 1) // 2) // (limit - 1) for i in range(limit)})
    return [sizes[i] for i in picks]


def largest_batch_bucket(override: Mapping[str, Any]) -> int | None:
    """The largest of the user's `token_generation_batches`, validated as every grid is
    (a malformed list is refused naming the key); None when not given."""
    if "token_generation_batches" not in override:
        return None
    return _grid(override, "token_generation_batches", [], maximum=None)[-1]


def _grid(
    override: Mapping[str, Any],
    key: str,
    default: list[int],
    *,
    maximum: int | None,
    limit_name: str = "the maximum",
    covers: int | None = None,
    why: str = "",
    align: int | None = None,
) -> tuple[int, ...]:
    """A user grid validated against its limit (named in the message), with `covers`
    against the largest need it must serve (`why` says whose need) and with `align`
    against the KV block size."""
    if key not in override:
        return tuple(default)
    try:
        return validate_grid(
            override[key],
            name=f"override_neuron_config.{key}",
            maximum=maximum,
            covers=covers,
            limit_name=limit_name,
            align=align,
        )
    except BucketError as exc:
        raise NeuronConfigError(f"{exc} ({why})" if why else str(exc)) from None


def resolve_grids(
    limits: EngineLimits,
    override: Mapping[str, Any],
    kv_layout: str,
    max_context_length: int,
    *,
    block_size: int,
    speculation_length: int = 0,
    host_default: str | None = None,
    one_batch_reason: str | None = None,
) -> dict[str, tuple[int, ...]]:
    """Bucket grids: NxDI's powers of two by default (so existing configurations keep
    their meaning), the user's lists when given, one full-size graph when bucketing is
    off.

    In the block layout every token-generation and prefix bucket is a whole number of
    KV blocks: NxDI hands a graph of length L the first L // pa_block_size blocks of the
    block table (model_wrapper._pad_prefix_caching_inputs), so the positions of a partial
    last block would never be attended. Defaults are rounded up to whole blocks (the
    largest to max_model_len rounded up; the nxd backend raises NxDI's seq_len to it),
    user lists must already be whole blocks. `block_size` is resolve_blocks' choice.

    With speculation a token-generation graph computes `speculation_length` positions
    from a row's last token, and NxDI picks its bucket by the attention mask's length
    plus speculation_length (strictly below the bucket), so decoding at position
    max_model_len - 2 needs a bucket of max_model_len + speculation_length - 1: the
    largest token-generation bucket reaches that far (the positions past max_model_len
    are written to no request's cache).

    Decode batches: `default_batches` (at most `max_batch_buckets` sizes) unless the
    backend serves one decode batch size in this configuration (`one_batch_reason` says
    why: max_num_seqs alone), or the user's token_generation_batches.

    `host_default`: why a request that sets no sampling parameters is sampled on the
    host (core.sampling.default_request_refusal), None where the device samples it; it
    decides the default logits twins (logits_lengths)."""
    enable = bool_setting(override, "enable_bucketing")
    enable = True if enable is None else enable
    seq = limits.max_model_len
    batch = limits.max_num_seqs
    block = kv_layout == BLOCK
    unit = block_size if block else 1
    reach = -(-seq // unit) * unit
    reach_name = (
        f"max_model_len rounded up to whole {unit}-token KV blocks" if block else "max_model_len"
    )
    # What decoding reaches: max_model_len, plus the speculation lookahead.
    decode = seq + max(speculation_length - 1, 0)
    decode_reach = -(-decode // unit) * unit
    decode_need = (
        f"decoding reaches max_model_len={seq}"
        if decode == seq
        else f"decoding with speculation_length={speculation_length} reaches "
        f"max_model_len + {speculation_length - 1} = {decode}"
    )
    if not enable:
        given = [key for key in (*GRID_KEYS, LOGITS_KEY, BATCH_LIMIT_KEY) if key in override]
        if given:
            raise NeuronConfigError(
                f"override_neuron_config.enable_bucketing=false but {', '.join(given)} "
                f"given; remove the bucket lists or set enable_bucketing=true."
            )
        return {
            "context_encoding_buckets": (max_context_length,),
            "token_generation_buckets": (decode_reach,),
            "prefix_buckets": (0, reach) if block else (),
            "token_generation_batches": (batch,),
            LOGITS_KEY: (decode_reach,),  # the twin of the one token-generation graph
        }
    ctx_default = nxdi_buckets(min(MIN_BUCKET, max_context_length), max_context_length)
    prefix_default = align_up(nxdi_buckets(min(MIN_BUCKET, seq), seq), unit)
    # NxDI's grid for max_model_len, plus the lookahead's reach as one more bucket (NxDI's
    # own grid for that reach would drop the power of two just below it).
    tkg_default = prefix_default + ([decode_reach] if decode_reach > prefix_default[-1] else [])
    grids = {
        # With chunked prefill a chunk of up to max_num_batched_tokens must fit one graph.
        "context_encoding_buckets": _grid(
            override,
            "context_encoding_buckets",
            ctx_default,
            maximum=max_context_length,
            limit_name="max_context_length",
            covers=min(limits.max_num_batched_tokens, max_context_length)
            if limits.enable_chunked_prefill
            else None,
            why=(
                f"a chunk of max_num_batched_tokens={limits.max_num_batched_tokens} "
                f"must fit one graph"
                if limits.enable_chunked_prefill
                else ""
            ),
        ),
        # Decoding walks every position up to max_model_len, so the largest
        # token-generation bucket must reach it or a long request would fail mid-way.
        "token_generation_buckets": _grid(
            override,
            "token_generation_buckets",
            tkg_default,
            maximum=decode_reach,
            limit_name=reach_name if decode == seq else f"max_model_len + {decode - seq}",
            covers=decode,
            align=unit if block else None,
            why=decode_need + (f"; NxDI reads whole blocks of block_size={unit}" if block else ""),
        ),
        "token_generation_batches": _grid(
            override,
            "token_generation_batches",
            _batches_default(override, batch, one_batch_reason),
            maximum=batch,
            limit_name="max_num_seqs",
            covers=batch,
            why=f"max_num_seqs={batch} requests can decode together",
        ),
    }
    if grids["context_encoding_buckets"][0] < 2:
        raise NeuronConfigError(
            f"override_neuron_config.context_encoding_buckets="
            f"{list(grids['context_encoding_buckets'])} has a bucket of 1 token: NxDI runs "
            f"an input one token wide through token generation (model_base."
            f"_is_context_encoding needs more than one), so that graph would be traced as "
            f"a decode; remove 1 (a one-token prompt runs in the smallest bucket)."
        )
    if block:
        if "prefix_buckets" in override:
            values = list(override["prefix_buckets"] or [])
            # A cached prefix or earlier chunks can reach max_model_len - 1 tokens.
            prefix = _grid(
                {"prefix_buckets": [v for v in values if v != 0]},
                "prefix_buckets",
                [],
                maximum=reach,
                limit_name=reach_name,
                covers=seq - 1,
                align=unit,
                why=f"a cached prefix can reach max_model_len - 1 = {seq - 1}; "
                f"NxDI reads whole blocks of block_size={unit}",
            )
            grids["prefix_buckets"] = (0, *prefix)
        else:
            grids["prefix_buckets"] = (0, *tuple(prefix_default))
    elif "prefix_buckets" in override:
        raise NeuronConfigError(
            "override_neuron_config.prefix_buckets applies to the block KV layout, but "
            "prefix caching and chunked prefill are off; remove prefix_buckets or pass "
            "--enable-prefix-caching."
        )
    else:
        grids["prefix_buckets"] = ()
    grids[LOGITS_KEY] = logits_lengths(
        override, grids["token_generation_buckets"], host_default is not None
    )
    return grids


def _batches_default(
    override: Mapping[str, Any], max_num_seqs: int, one_batch_reason: str | None
) -> list[int]:
    """The decode batch sizes when token_generation_batches is not given (see
    default_batches), checking `max_batch_buckets` against what it bounds."""
    name = f"override_neuron_config.{BATCH_LIMIT_KEY}"
    limit = override.get(BATCH_LIMIT_KEY, DEFAULT_MAX_BATCH_BUCKETS)
    if BATCH_LIMIT_KEY in override:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise NeuronConfigError(
                f"{name}={limit!r} must be a whole number >= 1 (1: one decode batch "
                f"size, max_num_seqs); fix the value or remove the key."
            )
        if "token_generation_batches" in override:
            raise NeuronConfigError(
                f"{name}={limit} bounds the default decode batch sizes, but "
                f"token_generation_batches={list(override['token_generation_batches'])} "
                f"lists them; remove one of the two keys."
            )
        if one_batch_reason and limit > 1:
            raise NeuronConfigError(
                f"{name}={limit} asks for several decode batch sizes, but this "
                f"configuration serves one ({one_batch_reason}); remove {BATCH_LIMIT_KEY} "
                f"or set it to 1."
            )
    if one_batch_reason:
        return [max_num_seqs]
    return default_batches(max_num_seqs, limit)


def logits_lengths(
    override: Mapping[str, Any], lengths: tuple[int, ...], host_by_default: bool = False
) -> tuple[int, ...]:
    """`token_generation_logits_buckets`: the context lengths whose token-generation
    graphs get a logits twin (nxd backend, on-device sampling). A decode with a
    host-sampled row runs the first twin that fits its longest row, so the largest
    length must have one. By default it alone does where a request that sets nothing
    is sampled on the device (one NEFF more rather than one a length: host-sampled steps
    are then the rare ones), and every length has one where such a request is sampled on
    the host (`host_by_default`: a model whose generation config sets a penalty or
    min_p, or exact sampling of requests without top_k), so that every decode of a
    default request runs at its own bucket; the key chooses the set itself."""
    if LOGITS_KEY not in override:
        return lengths if host_by_default else lengths[-1:]
    name = f"override_neuron_config.{LOGITS_KEY}"
    try:
        chosen = validate_grid(override[LOGITS_KEY], name=name)
    except BucketError as exc:
        raise NeuronConfigError(str(exc)) from None
    unknown = [n for n in chosen if n not in lengths]
    if unknown:
        raise NeuronConfigError(
            f"{name} has {unknown}, not in token_generation_buckets {list(lengths)}: a "
            f"logits graph is the twin of a token-generation graph; choose among those "
            f"lengths."
        )
    if chosen[-1] != lengths[-1]:
        raise NeuronConfigError(
            f"{name}={list(chosen)} lacks the largest token-generation bucket "
            f"{lengths[-1]}: a decode with a host-sampled row past {chosen[-1]} tokens "
            f"would have no graph; add {lengths[-1]}."
        )
    return chosen


def logits_note(
    override: Mapping[str, Any],
    chosen: tuple[int, ...],
    lengths: tuple[int, ...],
    host_default: str | None,
) -> str:
    """What the logits twins mean for a request that sets no sampling parameters, for
    the start-up log and explain-config ('' where the device samples it)."""
    if host_default is None or not chosen:
        return ""
    if LOGITS_KEY not in override:
        return (
            f"a request that sets no sampling parameters is sampled on the host "
            f"({host_default}), so every token-generation length has a logits twin "
            f"({len(chosen)} graphs more to compile and cache) and such a request decodes "
            f"at its own bucket; {LOGITS_KEY} chooses fewer twins (fewer graphs, longer "
            f"steps)"
        )
    missing = [n for n in lengths if n not in chosen]
    if not missing:
        return ""
    return (
        f"a request that sets no sampling parameters is sampled on the host "
        f"({host_default}), but override_neuron_config.{LOGITS_KEY}={list(chosen)} has no "
        f"twin at {missing}: each decode step of such a request whose longest row is "
        f"shorter runs at the next length that has one, reading the KV cache that far "
        f"(up to {chosen[-1]} positions a row instead of {lengths[0]}); add those lengths "
        f"(one graph each) or remove the key"
    )
