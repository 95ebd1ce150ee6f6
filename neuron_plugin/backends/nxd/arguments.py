"""The NxDI forward arguments for a call of the NxD contract (`core.inputs.ForwardInputs`).

Choices that follow from NxDI's code (NxDI 0.7-0.9, neuronx-distributed's router):
- A compiled graph takes inputs of exactly the shapes it was traced with: NxD's router
  looks every input up by its exact shape (neuronx-distributed trace/spmd.py
  NxDModel.router), and so does the plugin's routing by tag (`graphs.TaggedGraphs`),
  batch rows included, so every call carries `sampling_params` with exactly its rows
  (see `backend.NxDBackend._call`).
- Context encoding: one row (ctx_batch_size=1). Contiguous layout: input ids and
  positions at the bucket's width, the attention mask at the prompt's width (NxDI picks
  the bucket from the mask). Block layout: the whole context [0, end) as input_ids (NxDI
  re-encodes the tail of the prefix into spare active slots) with the slots of the new
  tokens.
- Token generation: the bucket's whole batch, sorted by seq_id, pad rows for the missing
  seq_ids of range(batch) as NxDI completes a batch, so NxDI has nothing to fill: its
  partial-batch handling (seq_ids completed from range(batch), which loses rows whose
  seq_id is not below the batch, and the prefix-caching return `logits[:n]` applied to
  the list [tokens, logits] when output_logits is on) never changes a call. Contiguous
  calls pass an attention mask whose width makes NxDI's length choice (first bucket >
  width in its 1-D path, >= width in the 0.8+ batch-bucketing path) the plugin's first
  fit. A call of a token-generation logits graph (`graphs`) takes NxDI's 1-D path at
  the full batch: NxDI batch-buckets only the submodel tagged token_generation_model
  (model_wrapper.get_target_bucket, `self.tag == TOKEN_GENERATION_MODEL_TAG`), and adds
  the speculation lookahead only for the tags speculation_model and
  fused_speculation_model, so n-gram speculation's logits variant gets a mask
  speculation_length columns wider (zeros, as NxDI pads it).
- Speculative decoding (core.speculation), as NxDI's generation models take it
  (model_base.py NeuronBaseForCausalLM._get_model_outputs, ef2731e lines 3549-3735):
  n-gram rows go to the speculation model with input ids and positions [rows,
  speculation_length] (the last token and the drafts at p..p+N) and the same explicit
  mask over positions < p (NxDI's inferred mask would cover the drafts' positions as
  cached ones, `_infer_attention_mask`); NxDI's speculation bucket rule is mask width +
  speculation_length < bucket, which is the plugin's need p + 1 + speculation_length.
  Fused draft-model rows pass one token per row at p: in the contiguous layout with that
  mask, in the block layout with the [rows, speculation_length] slot mapping of the
  positions the graph writes (-1 past the row's draft budget: NxDI writes those to its
  reserved extra block, block_kv_cache_manager `_update_cache_into_block_layout`) and
  full/computed context lengths p + 1 / p, as vllm-neuron passes them: NxDI's fused
  graph counts one query per row and picks the bucket with prefix > p +
  speculation_length (model_wrapper.get_target_2d_bucket_for_prefix_caching).
  EAGLE decodes clip positions to the bucket less speculation_length (model_base.py
  NeuronFusedSpecModel.forward), so a contiguous call with pad rows runs the largest
  length (core.inputs), its mask as wide as that length less speculation_length + 1.
"""

from __future__ import annotations

import numpy as np

from neuron_plugin.backends.nxd.neuron_config import batch_bucketing
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    PAD_SLOT,
    ForwardInputs,
    context_encoding_inputs,
    context_encoding_need,
    token_generation_inputs,
)
from neuron_plugin.core.settings import NeuronSettings


def model_arguments(
    settings: NeuronSettings, inputs: ForwardInputs, logits: bool = False
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The NxDI forward arguments for `inputs` (see the module docstring) and, for each
    real row of `inputs`, the row of NxDI's output that answers it; `logits`: a decode
    runs a token-generation logits graph."""
    if inputs.phase == CONTEXT_ENCODING:
        return _context_arguments(settings, inputs), np.zeros(1, dtype=np.int64)
    return _decode_arguments(settings, inputs, logits)


def _decode_graph(settings: NeuronSettings, inputs: ForwardInputs, logits: bool) -> tuple[int, int]:
    """(rows, columns the attention mask gets beyond the longest row's positions) of
    the token-generation graph a decode runs, so that NxDI's length choice is the
    plugin's first fit: one in NxDI's 2-D batch-bucketing path (bucket >= width, not >);
    a logits graph takes the full batch in the 1-D path (a decode built for a smaller
    batch bucket is padded up to it), and n-gram speculation's logits variant, whose tag
    NxDI adds no lookahead for (graphs), speculation_length zero columns."""
    if logits and settings.token_generation_logits_shapes():
        return settings.token_generation_logits_shapes()[0][0], settings.speculation_length
    return inputs.bucket[0], int(batch_bucketing(settings))


def context_positions(length: int, width: int, window: int | None) -> np.ndarray:
    """[1, width] position ids of a contiguous prefill of `length` tokens, padded as NxDI
    pads them (model_wrapper.pad_inputs: 1). NxDI answers for the query at
    argmax(position_ids), the first maximum, and with `windowed_context_encoding_size`
    takes a window as padding only if all its positions are 1 (model_base.py
    NeuronBaseModel.forward, `is_valid_window`). A one-token prompt (position 0) would
    lose the argmax to a pad at 1, so its pads keep 0 within the first window (the whole
    bucket without windows) and are 1 after it."""
    positions = np.ones((1, width), dtype=np.int64)
    positions[0, :length] = np.arange(length)
    if length == 1:
        positions[0, : window or width] = 0
    return positions


def _context_arguments(settings: NeuronSettings, inputs: ForwardInputs) -> dict[str, np.ndarray]:
    end, start = int(inputs.full_context_lens[0]), int(inputs.computed_context_lens[0])
    args = {
        "seq_ids": inputs.seq_ids[:1],
        "full_context_lens": inputs.full_context_lens[:1].reshape(1, 1),
        "computed_context_lens": inputs.computed_context_lens[:1].reshape(1, 1),
    }
    if inputs.adapter_slots is not None:  # the plugin's slots; the backend maps them
        args["adapter_ids"] = inputs.adapter_slots[:1]
    if not settings.is_block_layout:
        # The mask's width (the prompt's) is what NxDI picks the bucket from.
        window = settings.passthrough.get("windowed_context_encoding_size")
        args.update(
            input_ids=inputs.input_ids[:1],
            position_ids=context_positions(end, inputs.bucket[0], window),
            attention_mask=np.ones((1, end), dtype=np.int64),
        )
        return args
    slots, table = inputs.block_arrays()
    args.update(
        input_ids=np.asarray(inputs.whole_context()[:end], dtype=np.int64)[None, :],
        position_ids=np.arange(end, dtype=np.int64)[None, :],
        slot_mapping=slots[:1, : end - start],
        block_table=table[:1],
    )
    return args


def _decode_arguments(
    settings: NeuronSettings, inputs: ForwardInputs, logits: bool
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    (rows, extra), real = _decode_graph(settings, inputs, logits), inputs.num_real
    seq = inputs.seq_ids[:real]
    missing = np.setdiff1d(np.arange(rows), seq)
    if missing.size != rows - real:
        raise ValueError(
            f"decode rows with seq_ids {seq.tolist()} do not fit the batch bucket {rows} "
            f"(NxDI serves seq_ids 0..{rows - 1} with it); this is a plugin bug, please "
            f"report it with your --max-num-seqs and token_generation_batches."
        )
    seq_ids = np.concatenate([seq, missing])
    order = np.argsort(seq_ids, kind="stable")
    pad = order >= real
    source = np.where(pad, 0, order)
    args = {
        "input_ids": inputs.input_ids[source],
        "position_ids": inputs.position_ids[source],
        "seq_ids": seq_ids[order],
        "full_context_lens": inputs.full_context_lens[source].reshape(-1, 1),
        "computed_context_lens": inputs.computed_context_lens[source].reshape(-1, 1),
    }
    if inputs.adapter_slots is not None:  # pad rows: the base model's slot 0
        args["adapter_ids"] = np.where(pad, 0, inputs.adapter_slots[source])
    if settings.is_block_layout:
        slots, table = inputs.block_arrays()
        args["slot_mapping"] = np.where(pad[:, None], PAD_SLOT, slots[source])
        args["block_table"] = decode_block_table(
            settings, table[source], args["full_context_lens"][:, 0]
        )
        if settings.is_fused_speculation:
            args["full_context_lens"] = args["computed_context_lens"] + 1
        return args, np.argsort(order)[:real]
    # A pad row writes its token into the cache line of its seq_id, which may hold a
    # request outside this batch (one prefilled this step): at the last position, which
    # no request reads before writing it itself (NxDI's own garbage position,
    # kv_cache_manager.update_kv_by_layer_id), rather than at a copied row's position.
    # With speculation it writes there and at the next speculation_length - 1 positions,
    # which NxDI's seq_len (the largest bucket, max_model_len + speculation_length - 1)
    # holds; a fused graph's draft mask (index_fill_ of each row's p + i, past the
    # mask for a pad row) is a scatter on the device, whose out-of-bounds indices XLA
    # skips.
    last = settings.max_model_len - 1
    args["input_ids"][pad] = 0
    args["position_ids"][pad] = last
    args["full_context_lens"][pad] = last + 1
    args["computed_context_lens"][pad] = last
    positions = np.where(pad, 0, args["position_ids"][:, 0])
    width = int(positions.max()) + extra
    if settings.is_eagle:
        # the length core.inputs chose (the largest where pad rows would be clipped),
        # which NxDI picks from the mask: the first bucket > width + speculation_length
        width = max(width, inputs.bucket[1] - settings.speculation_length - 1)
    args["attention_mask"] = (np.arange(width)[None, :] < positions[:, None]).astype(np.int64)
    return args, np.argsort(order)[:real]


# NeuronConfig keys of the token-generation attention kernels; 0.9 turns the two older
# ones into attn_block_tkg_nki_kernel_enabled (models/config.py, ef2731e lines 458-466).
TKG_KERNEL_KEYS = (
    "attn_block_tkg_nki_kernel_enabled",
    "attn_tkg_nki_kernel_enabled",
    "attn_tkg_builtin_kernel_enabled",
)


def decode_block_table(
    settings: NeuronSettings, table: np.ndarray, full_context_lens: np.ndarray
) -> np.ndarray:
    """A decode call's block tables as NxDI pads them: with a token-generation attention
    kernel the columns past a row's blocks are -1, which the kernel skips instead of
    reading vLLM's null block (model_wrapper._pad_prefix_caching_inputs, and vllm-neuron
    likewise); without one NxDI pads with 0 and the plugin's null-block padding is it."""
    if not any(settings.passthrough.get(key) for key in TKG_KERNEL_KEYS):
        return table
    used = -(-full_context_lens // settings.block_size)
    return np.where(np.arange(table.shape[1])[None, :] < used[:, None], table, -1)


def padding_arguments(
    settings: NeuronSettings, inputs: ForwardInputs, logits: bool = False
) -> dict[str, np.ndarray]:
    """Arguments that make NxDI run the graph of `inputs.bucket` (`logits`: its
    token-generation logits graph) for a padding-only call (warm-up, measurement): NxDI
    has no padding calls, so a stand-in request of zeros whose need runs that graph. In
    the block layout it writes no KV (slot -1); the contiguous layout has no scratch
    line, so it writes sequence lines 0.. (call it before serving only)."""
    block = settings.is_block_layout
    if inputs.phase == CONTEXT_ENCODING:
        new, cached = context_encoding_need(settings, inputs.bucket)
        stand_in = context_encoding_inputs(
            settings, np.zeros(new + cached, dtype=np.int64), cached, 0, []
        )
    else:
        # The last position whose need (p + 1 + speculation_length) fits the bucket; with
        # speculation at most max_model_len - 2, the last position a request decodes at
        # (the largest bucket reaches past it by the lookahead, in whole blocks).
        rows, length = inputs.bucket
        position = length - 1 - settings.speculation_length
        if settings.speculation_length:
            position = min(position, settings.max_model_len - 2)
        stand_in = token_generation_inputs(
            settings,
            np.zeros(rows, dtype=np.int64),
            np.full(rows, max(position, 1), dtype=np.int64),
            np.arange(rows, dtype=np.int64),
            [[]] * rows if block else None,
            logits=logits,
        )
    if stand_in.bucket != tuple(inputs.bucket):
        raise ValueError(
            f"no request runs the {inputs.phase} graph {inputs.bucket} (a "
            f"stand-in runs {stand_in.bucket}); it is not one of the settings' "
            f"graph shapes"
        )
    args, _ = model_arguments(settings, stand_in, logits)
    if block:
        args["slot_mapping"] = np.full_like(args["slot_mapping"], PAD_SLOT)
    return args
