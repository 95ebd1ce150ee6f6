"""The resolved settings as NxDI's NeuronConfig keyword arguments.

NxDI gets explicit bucket lists, always with `enable_bucketing=True`, so it compiles
exactly the graphs the settings list (bucketing "off" is a one-bucket grid). NxDI adds
prefix length 0 to the prefix grid itself, so it is not passed. Every key NxDI would
drop, and every passed-through key the backend needs set otherwise, is an error.

Speculative decoding (core.speculation) with N = num_speculative_tokens drafts:
- ngram: `speculation_length` N + 1 without fused speculation, so NxDI builds its
  speculation model (the target over N + 1 input tokens) instead of the
  token-generation model (model_base.py NeuronBaseForCausalLM.__init__, ef2731e lines
  3057-3068), contiguous layout only (refused otherwise in core.speculation);
- draft_model: `enable_fused_speculation` with `speculation_length` N + 1, and the
  InferenceConfig's `fused_spec_config` built as vllm-neuron's `_init_fused_spec_config`
  builds it (`draft_neuron_config`; the backend assembles it);
- eagle / eagle3: the same with `enable_eagle_speculation` (and `is_eagle3`), the head's
  NeuronConfig `is_eagle_draft` keeping the speculation length, as NxDI's own
  inference_demo.py builds it ("eagle requires the draft model to have speculation
  enabled for the last draft run"); the head's folder as NxDI loads it (nxd.eagle);
  EAGLE-3 with `sequence_parallel_enabled` (see neuron_config_kwargs).
The on-device sampler stays dynamic without do_sample: NxDI then verifies every position
with the target's argmax (model_base.py `_sample_on_device`, lines 1163-1173).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from neuron_plugin.core.checkpoint import text_config
from neuron_plugin.core.neuron_settings import EAGLE3
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

# Passed-through NeuronConfig keys the backend completes rather than replaces.
MERGED_KEYS = frozenset({"on_device_sampling_config"})


def neuron_config_kwargs(settings: NeuronSettings) -> dict[str, Any]:
    """NeuronConfig(**kwargs) for the settings (see the module docstring for why); a
    passed-through override_neuron_config key that the plugin sets differently is an
    error rather than a silent overwrite."""
    s = settings
    derived: dict[str, Any] = {
        "tp_degree": s.tp_degree,
        "batch_size": s.max_num_seqs,
        "ctx_batch_size": s.ctx_batch_size,
        "tkg_batch_size": s.max_num_seqs,
        # NxDI requires every token-generation bucket <= seq_len; in the block layout the
        # largest is max_model_len rounded up to whole KV blocks (settings.resolve_grids).
        "seq_len": max(s.max_model_len, s.token_generation_buckets[-1]),
        "max_context_length": s.max_context_length,
        "torch_dtype": s.dtype,
        "padding_side": "right",
        "is_continuous_batching": s.passthrough.get("is_continuous_batching", s.max_num_seqs > 1),
        "enable_bucketing": True,
        "context_encoding_buckets": list(s.context_encoding_buckets),
        "token_generation_buckets": list(s.token_generation_buckets),
        "is_block_kv_layout": s.is_block_layout,
        "is_prefix_caching": s.is_block_layout,
    }
    if s.is_block_layout:
        derived.update(
            prefix_buckets=[p for p in s.prefix_buckets if p != 0],
            pa_num_blocks=s.num_blocks,
            pa_block_size=s.block_size,
        )
        check_block_tiling(s, s.passthrough.get("max_length", derived["seq_len"]))
    if batch_bucketing(s):
        derived["token_generation_batches"] = list(s.token_generation_batches)
    if s.speculation_method:
        check_speculation_settings(s)
        derived["speculation_length"] = s.speculation_length
        derived["enable_fused_speculation"] = s.is_fused_speculation
        if s.is_eagle:
            derived["enable_eagle_speculation"] = True
            derived["is_eagle3"] = s.speculation_method == EAGLE3
        if s.speculation_method == EAGLE3:
            # NxDI's EAGLE-3 target answers a prefill from its last position only through
            # sequence parallelism (seq_parallel_slice_last_token over the 4 fused hidden
            # sizes, model_base.py NeuronBaseModel.get_model_output); otherwise it gathers
            # one hidden size of the four (NeuronBaseModel.forward, `expand(batch_size, 1,
            # self.hidden_size)`) and its lm_head gets an empty slice: measured on 0.8 and
            # 0.9 (tests/e2e/test_nxdi_eagle.py)
            derived["sequence_parallel_enabled"] = True
    if s.on_device_sampling:
        derived["on_device_sampling_config"] = on_device_sampling_config(
            s.passthrough.get("on_device_sampling_config") or {}, s.global_topk
        )
        # Logits as well as tokens from the context-encoding graphs (one row a call)
        # and the token-generation logits graphs, so requests on-device sampling cannot
        # serve are sampled on the host from the same call; the other token-generation
        # graphs return tokens alone (graphs.add_logits_graphs). Not with fused
        # speculation: its context encoding lists the draft's and target's logits twice
        # before the KV caches (model_base.py _context_encoding_forward, ef2731e lines
        # 1800-1809) while the wrapper aliases the caches from a fixed index
        # (model_wrapper.py 1588-1610), and vllm-neuron never compiles it with logits;
        # requests that need the host sampler are refused instead
        # (core.speculation.host_sampling_refusal).
        derived["output_logits"] = not s.is_fused_speculation
    clashes = sorted(
        k
        for k in derived
        if k in s.passthrough and k not in MERGED_KEYS and s.passthrough[k] != derived[k]
    )
    if clashes:
        raise NeuronConfigError(
            "; ".join(
                f"override_neuron_config.{k}={s.passthrough[k]!r} but the nxd backend "
                f"needs {derived[k]!r}"
                for k in clashes
            )
            + "; remove the key(s) (the backend sets output_logits: on with on-device "
            "sampling, off with fused speculation)."
        )
    return {**s.passthrough, **derived}


def on_device_sampling_config(user: Mapping[str, Any], global_topk: int) -> dict[str, Any]:
    """The user's OnDeviceSamplingConfig fields with the resolved global_topk and
    `dynamic=True` (as vllm-neuron sets it): NxDI's Sampler is argmax unless do_sample
    or dynamic is set, and without dynamic it applies the temperature and top-p traced
    at compile time instead of each row's (NxDI modules/generation/sampling.py Sampler).
    `deterministic` stays the user's (default False: a fixed 0.5 draw otherwise)."""
    if user.get("dynamic", True) is not True:
        raise NeuronConfigError(
            f"override_neuron_config.on_device_sampling_config.dynamic="
            f"{user['dynamic']!r}: NxDI's on-device sampler then ignores each request's "
            f"temperature and top-p (greedy unless do_sample is set); remove dynamic "
            f"(the nxd backend sets it to true)."
        )
    return {
        **user,
        "global_topk": global_topk,
        "dynamic": True,
        "deterministic": bool(user.get("deterministic", False)),
    }


def block_rows_per_tile(block_size: int, max_length: int) -> int:
    """Rows of a KV block tile in NxDI's prefix-caching cache: with fewer than 128 blocks
    per sequence it splits each block into the smallest power of 2 >= 128 / blocks tiles
    (block_kv_cache_manager.py _init_kv_shape_for_prefix_caching, ef2731e lines 48-77)."""
    per_seq = -(-max_length // block_size)
    if per_seq >= 128:
        return block_size
    return block_size // 2 ** math.ceil(math.log2(128 / per_seq))


def check_block_tiling(settings: NeuronSettings, max_length: int) -> None:
    """Refuse a block layout whose tiled KV cache NxDI would make empty (0 rows a tile:
    every write out of bounds), naming the smallest max_model_len that works."""
    if settings.passthrough.get("attn_block_tkg_nki_kernel_enabled"):
        return  # NxDI does not tile with the block token-generation kernel
    size = settings.block_size
    if block_rows_per_tile(size, max_length) > 0:
        return
    enough = next(n for n in range(max_length, 128 * size + 1) if block_rows_per_tile(size, n))
    raise NeuronConfigError(
        f"max_model_len={settings.max_model_len} is too short for NxDI's block KV layout "
        f"with --block-size {size}: its prefix-caching cache splits each block into "
        f"tiles by 128 / blocks per sequence (block_kv_cache_manager.py "
        f"_init_kv_shape_for_prefix_caching), which leaves {size}-token blocks with 0 "
        f"rows a tile at {max_length} tokens; pass --max-model-len {enough} or more, or "
        f"serve without --enable-prefix-caching and chunked prefill (contiguous layout)."
    )


def check_speculation_settings(settings: NeuronSettings) -> None:
    """Refuse, naming the fix, speculation settings NxDI would run wrongly."""
    flag = f"--speculative-config method {settings.speculation_method!r}"
    user = settings.passthrough.get("on_device_sampling_config") or {}
    if user.get("do_sample"):
        raise NeuronConfigError(
            f"override_neuron_config.on_device_sampling_config.do_sample=true with "
            f"{flag}: NxDI then samples one token from the last verified position instead "
            f"of verifying each one (model_base.py _sample_on_device, 'FIXME, "
            f"logits[:, -1, :] is not correct for speculation model'), which its "
            f"acceptance cannot use; remove do_sample (per-request sampling stays on "
            f"through dynamic) or remove --speculative-config."
        )
    k = settings.speculation_length
    if k in settings.context_encoding_buckets:
        raise NeuronConfigError(
            f"override_neuron_config.context_encoding_buckets contains {k}, the "
            f"speculation_length of {flag} (num_speculative_tokens + 1): NxDI routes a "
            f"{k}-token input to its speculation path, so that context-encoding graph "
            f"would never encode a prompt (model_base.py _is_context_encoding, "
            f"NeuronFusedSpecModel.forward); use other context_encoding_buckets or "
            f"another num_speculative_tokens."
        )


def check_speculation_models(
    settings: NeuronSettings, target: Mapping[str, Any], draft: Mapping[str, Any] | None
) -> None:
    """Refuse, naming the fix, checkpoints NxDI's speculation cannot serve: sliding-window
    attention (NxDI's speculative masks for it need the cascaded token-generation
    attention kernel, model_base.py _create_windowed_attn_mask_spec_decode, and its
    non-fused speculation model has none) and a draft of another vocabulary."""
    if not settings.speculation_method:
        return
    flag = f"--speculative-config method {settings.speculation_method!r}"
    for name, config in (("the model", target), ("the draft model", draft)):
        if config is None:
            continue
        text = text_config(dict(config))
        window = text.get("sliding_window")
        if window is not None and text.get("use_sliding_window", True) is not False:
            raise NeuronConfigError(
                f"{flag} on the nxd backend: {name} uses sliding-window attention "
                f"(sliding_window={window}), which NxDI verifies drafts for only with "
                f"its cascaded token-generation attention kernel (model_base.py "
                f"_create_windowed_attn_mask_spec_decode) and not in its speculation "
                f"model; remove --speculative-config for this model."
            )
    if draft is not None:
        target_vocab = text_config(dict(target)).get("vocab_size")
        draft_vocab = text_config(dict(draft)).get("vocab_size")
        if target_vocab != draft_vocab:
            raise NeuronConfigError(
                f"--speculative-config model={settings.draft_model}: the draft's "
                f"vocabulary has {draft_vocab} tokens, the model's {target_vocab}; NxDI "
                f"compares draft and target token ids, so the draft must share the "
                f"model's tokenizer and vocabulary: use a draft of the same family."
            )


def draft_neuron_config(target: Any) -> Any:
    """A fused draft model's NeuronConfig as vllm-neuron builds it
    (neuronx_distributed_model_loader.py `_init_fused_spec_config`): a copy of the
    target's without fused speculation of its own (NxDI would otherwise nest it), with
    `draft_model_modules_to_not_convert` as its modules_to_not_convert where given. A
    draft model has no speculation length; an EAGLE head keeps it and is
    `is_eagle_draft` (NxDI inference_demo.py run_inference). Its buckets, batch sizes
    and sampler are the target's, as NxDI expects (model_base.py enable_fused_spec sets
    the draft's batch)."""
    draft = copy.deepcopy(target)
    eagle = bool(getattr(target, "enable_eagle_speculation", False))
    if not eagle:
        draft.speculation_length = 0
    draft.enable_fused_speculation = False
    draft.is_eagle_draft = eagle
    modules = getattr(target, "draft_model_modules_to_not_convert", None)
    if modules:
        draft.modules_to_not_convert = modules
    return draft


def unknown_kwargs(neuron_config: object, kwargs: Mapping[str, Any]) -> list[str]:
    """Keys NeuronConfig dropped (it logs and ignores unknown keys): an older NxDI
    would otherwise silently compile other graphs than the settings list."""
    return sorted(k for k in kwargs if not hasattr(neuron_config, k))


def batch_bucketing(settings: NeuronSettings) -> bool:
    """Whether NxDI gets token_generation_batches (its 0.8+ 2-D token-generation path)."""
    return tuple(settings.token_generation_batches) != (settings.max_num_seqs,)
