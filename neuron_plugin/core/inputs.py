"""Scheduler state -> the NxD forward contract, padded to the bucket NxDI runs for it.

Pure numpy, vectorised over tokens: per-step host cost must not grow with
`max_model_len` (the findings measured vLLM's host overhead at ~50 ms per batch).

The contract (see NEURON_FINDINGS.md):
- prefill of tokens [start, end): positions start..end-1, full_context_lens = end,
  computed_context_lens = start (a prefix-cache hit or an earlier chunk; 0 otherwise);
- decode at position p: one token, full = p + 1, computed = p;
- block layout: slot = block_table[pos // block_size] * block_size + pos % block_size,
  block tables padded with vLLM's null block (0) to ceil(max_model_len / block_size).
- speculative decode (core.speculation) at position p with a budget of d drafts: the
  graph computes positions p .. p + speculation_length - 1; input_ids hold the last token
  and the n-gram drafts (the last token only with a fused draft model, which proposes its
  own), full_context_lens = p + 1 + d (the positions whose tokens the step may keep),
  computed = p; the slot mapping covers every computed position, -1 past p + d.

Padding: pad tokens have slot -1 (write nothing) and id 0; pad batch rows have seq_id -1
and full_context_len 0, so a backend can tell them apart without extra arguments.

A hybrid model's per-sequence state (core.recurrent_state): in the block layout each row
names, per state layer, the vLLM block its state is read from (-1: it starts from zeros)
and the block it is left in (`state_slots`, from the blocks the request owns in its
state layers' KV cache groups); in the contiguous layout the sequence slot is the state
slot and nothing more is passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bucketing.fit import first_fit, prefix_caching_fit, prefix_caching_need
from neuron_plugin.core.settings import NeuronSettings

CONTEXT_ENCODING = "context_encoding"
TOKEN_GENERATION = "token_generation"
PAD_SLOT = -1
PAD_SEQ_ID = -1


@dataclass(frozen=True)
class ForwardInputs:
    """One backend call: arrays shaped by `bucket`, rows [0, num_real) are real."""

    phase: str
    bucket: tuple[int, ...]
    input_ids: np.ndarray  # [batch, active] int64
    position_ids: np.ndarray  # [batch, active] int64
    seq_ids: np.ndarray  # [batch] int64
    # [batch, active] int64, block layout only ([batch, speculation_length] for a
    # speculative decode: every position the graph computes)
    slot_mapping: np.ndarray | None
    block_table: np.ndarray | None  # [batch, max_blocks] int64, block layout only
    full_context_lens: np.ndarray  # [batch] int64
    computed_context_lens: np.ndarray  # [batch] int64
    num_real: int
    # Context encoding only: the request's token ids [0, full_context_len). NxDI's
    # prefix-caching graphs take the whole context as input_ids (vllm-neuron does too).
    context_ids: np.ndarray | None = None
    # Positions the graph computes per row where that is more than input_ids' width: a
    # fused draft model's decode takes one token per row and computes
    # speculation_length positions.
    width: int | None = None
    # [batch] int64 with LoRA on (settings.max_loras): each row's adapter slot, 0 (the
    # base model's zero slot) for rows without an adapter and for pads (core.adapters).
    adapter_slots: np.ndarray | None = None
    # Vision-language models (core.vision): embeddings [batch, active, hidden] float32
    # that replace the token embeddings where vision_mask [batch, active] bool is set
    # (the image placeholders this call computes); None in a call without images.
    vision_embeddings: np.ndarray | None = None
    vision_mask: np.ndarray | None = None
    # M-RoPE (the Qwen2-VL family): rotary positions [3, batch, active] int64 (temporal,
    # height, width); position_ids stays each token's KV position. None: every rotary
    # position is position_ids (text only, nothing shifted by an earlier image).
    rope_positions: np.ndarray | None = None
    # [1, active] int64, a context encoding that asks for prompt logprobs only: the
    # prompt token each position scores, core.prompt_logprobs.NO_TARGET where none.
    prompt_targets: np.ndarray | None = None
    # [batch, 2, state layers] int64, a hybrid model's block layout only: each row's
    # state slot to read per state layer (-1: zeros, a sequence's start) and to write
    # (-1 for pad rows); see `state_slots`.
    state_slots: np.ndarray | None = None

    @property
    def draft_budget(self) -> np.ndarray:
        """[batch] drafts each row of a speculative decode may accept (0 for pads, for
        context encodings and for calls without speculation)."""
        if self.phase != TOKEN_GENERATION:
            return np.zeros_like(self.full_context_lens)
        return np.maximum(self.full_context_lens - self.computed_context_lens - 1, 0)

    def block_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot_mapping, block_table) of a block-layout call."""
        if self.slot_mapping is None or self.block_table is None:
            raise ValueError(
                "a block-layout call without slot_mapping/block_table; this is a plugin "
                "bug, please report it with your --enable-prefix-caching/--block-size."
            )
        return self.slot_mapping, self.block_table

    def whole_context(self) -> np.ndarray:
        """The request's token ids [0, full_context_len) of a context encoding."""
        if self.context_ids is None:
            raise ValueError(
                f"a {self.phase} call carries no context ids; this is a plugin bug, "
                f"please report it."
            )
        return self.context_ids

    @property
    def real_tokens(self) -> int:
        return int((self.full_context_lens - self.computed_context_lens)[: self.num_real].sum())

    @property
    def padded_tokens(self) -> int:
        """Token slots computed for nothing: the telemetry's waste measure."""
        rows, active = self.input_ids.shape
        return rows * max(active, self.width or 0) - self.real_tokens


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of every position: block_table[pos // bs] * bs + pos % bs (row-wise)."""
    blocks = np.take_along_axis(block_table, positions // block_size, axis=1)
    return blocks * block_size + positions % block_size


def pad_block_tables(block_ids: Sequence[Sequence[int]], rows: int, width: int) -> np.ndarray:
    """[rows, width] table, each request's blocks then vLLM's null block (0)."""
    table = np.zeros((rows, width), dtype=np.int64)
    for row, ids in enumerate(block_ids):
        if len(ids) > width:
            raise ValueError(
                f"a request holds {len(ids)} KV blocks but the block table has {width} "
                f"columns (ceil(max_model_len / block_size)); this is a scheduler/plugin "
                f"mismatch, report it with your --max-model-len and --block-size."
            )
        table[row, : len(ids)] = ids
    return table


def context_encoding_bucket(
    settings: NeuronSettings, num_tokens: int, start: int
) -> tuple[int, ...]:
    """The graph for a prefill of `num_tokens` new tokens after `start` computed ones:
    the first fit, or in the block layout NxDI's own prefix-caching choice (which moves
    the tail of the prefix into spare active slots; see bucketing.fit)."""
    if settings.is_block_layout:
        return prefix_caching_fit(
            settings.context_encoding_buckets, settings.prefix_buckets, num_tokens, start
        )
    return (
        first_fit(
            settings.context_encoding_buckets,
            num_tokens,
            what="context-encoding bucket (prompt tokens)",
        ),
    )


def context_encoding_need(settings: NeuronSettings, shape: tuple[int, ...]) -> tuple[int, int]:
    """(new tokens, cached tokens) of a prefill that runs the context-encoding graph
    `shape` (warm-up and measurement drive each graph with one)."""
    if not settings.is_block_layout:
        return shape[0], 0
    need = prefix_caching_need(
        settings.context_encoding_buckets,
        settings.prefix_buckets,
        (shape[0], shape[1]),
        settings.max_model_len,
    )
    if need is None:
        raise ValueError(
            f"no prefill of at most max_model_len={settings.max_model_len} "
            f"tokens runs the context-encoding graph {tuple(shape)}; it is not "
            f"one of settings.context_encoding_shapes()"
        )
    return need


def token_generation_bucket(
    settings: NeuronSettings, batch: int, context_len: int, logits: bool = False
) -> tuple[int, int]:
    """First fit for a decode batch that needs `batch` rows and whose longest row needs
    `context_len` positions. The token-generation grid is a full cross product and cost
    grows in both dimensions, so the least-cost fitting shape is the first fit of each
    dimension. A call that needs logits (`logits`) where the configuration compiles
    separate logits graphs (`settings.token_generation_logits_shapes()`) runs one of
    those: the full batch, at the first of their lengths that fits (by default there is
    one, the largest: a host-sampled row at any context length runs there)."""
    batches, lengths = settings.token_generation_batches, settings.token_generation_buckets
    what = "token_generation_buckets"
    shapes = settings.token_generation_logits_shapes() if logits else []
    if shapes:
        batches = tuple(sorted({b for b, _ in shapes}))
        lengths, what = tuple(n for _, n in shapes), "token_generation_logits_buckets"
    return (
        first_fit(batches, batch, what="token_generation_batches (decode batch size)"),
        first_fit(lengths, context_len, what=f"{what} (context length)"),
    )


def _adapter_slots(
    settings: NeuronSettings, rows: int, given: np.ndarray | Sequence[int] | None
) -> np.ndarray | None:
    """[rows] adapter slots with LoRA on (given ones first, 0 after), None without."""
    if not settings.max_loras:
        return None
    slots = np.zeros(rows, dtype=np.int64)
    if given is not None:
        slots[: len(given)] = given
    return slots


def state_slots(
    group_blocks: Sequence[Sequence[int]],
    layer_groups: Sequence[int],
    computed: int,
    end: int,
    block_size: int,
) -> np.ndarray:
    """[2, state layers]: where a request's state is read from and left, per state layer
    (in the group `layer_groups` names), for a call computing its tokens [computed, end)
    from the blocks it owns in each state group (`group_blocks`, vLLM's block ids of the
    group, one per `block_size` positions). As vLLM's GPU runner reads them
    (v1/worker/mamba_utils.py preprocess_mamba): the state after position p lives in the
    block holding p, so a call starts from the block of its first computed token's
    predecessor (none at the start: zeros) and leaves the state in the block of its last
    token; with one block per request ('none' mode, block_size = max_model_len) both are
    that block. vLLM's null block 0 is never a real state: reading it raises."""
    read_column = (computed - 1) // block_size
    write_column = (end - 1) // block_size
    groups = np.full((2, len(group_blocks)), -1, dtype=np.int64)
    for g, blocks in enumerate(group_blocks):
        if computed > 0:
            groups[0, g] = blocks[read_column]
        groups[1, g] = blocks[write_column]
    if computed > 0 and (groups[0] <= 0).any():
        raise RuntimeError(
            f"a request's state at position {computed - 1} is in vLLM's null block "
            f"(state blocks {[list(b) for b in group_blocks]}); please report this"
        )
    return groups[:, list(layer_groups)]


def context_encoding_inputs(
    settings: NeuronSettings,
    context_ids: np.ndarray,
    start: int,
    seq_id: int,
    block_ids: Sequence[int] | None,
    adapter_slot: int = 0,
    state: np.ndarray | None = None,
) -> ForwardInputs:
    """One prefill (batch 1) of tokens [start, len(context_ids)) of a request, whose
    first `start` tokens are already in the KV cache (a prefix hit or earlier chunks);
    `state` [2, state layers]: a hybrid model's state slots in the block layout
    (`state_slots`).

    In the block layout NxDI routes a call whose input_ids have one column to its
    token-generation graph (model_base._get_model_outputs: context encoding needs more
    than one input token), so a one-token prompt is a one-row decode at position 0."""
    end = int(context_ids.shape[0])
    count = end - start
    if settings.is_block_layout and end == 1:
        return token_generation_inputs(
            settings,
            np.asarray(context_ids[:1]),
            np.zeros(1, dtype=np.int64),
            np.array([seq_id], dtype=np.int64),
            [block_ids or []],
            adapter_slots=[adapter_slot],
            state=None if state is None else state[None],
        )
    bucket = context_encoding_bucket(settings, count, start)
    active = bucket[0]
    ids = np.zeros((1, active), dtype=np.int64)
    ids[0, :count] = context_ids[start:]
    positions = np.zeros((1, active), dtype=np.int64)
    positions[0, :count] = np.arange(start, end)
    table = slots = None
    if settings.is_block_layout:
        table = pad_block_tables([block_ids or []], 1, settings.max_blocks_per_seq)
        slots = np.full((1, active), PAD_SLOT, dtype=np.int64)
        slots[:, :count] = slot_mapping(table, positions[:, :count], settings.block_size)
    return ForwardInputs(
        phase=CONTEXT_ENCODING,
        bucket=bucket,
        input_ids=ids,
        position_ids=positions,
        seq_ids=np.array([seq_id], dtype=np.int64),
        slot_mapping=slots,
        block_table=table,
        full_context_lens=np.array([end], dtype=np.int64),
        computed_context_lens=np.array([start], dtype=np.int64),
        num_real=1,
        context_ids=context_ids,
        adapter_slots=_adapter_slots(settings, 1, [adapter_slot]),
        state_slots=None if state is None else np.asarray(state, dtype=np.int64)[None],
    )


def decode_width(settings: NeuronSettings) -> int:
    """Positions a token-generation graph computes (and writes) per row."""
    return settings.speculation_length or 1


def decode_active(settings: NeuronSettings) -> int:
    """Input tokens per row of a token-generation graph: the last token, and the n-gram
    drafts where the host proposes them."""
    return 1 if settings.is_fused_speculation else decode_width(settings)


def token_generation_inputs(
    settings: NeuronSettings,
    token_ids: np.ndarray,
    positions: np.ndarray,
    seq_ids: np.ndarray,
    block_ids: Sequence[Sequence[int]] | None,
    drafts: np.ndarray | None = None,
    budget: np.ndarray | None = None,
    logits: bool = False,
    adapter_slots: np.ndarray | Sequence[int] | None = None,
    state: np.ndarray | None = None,
) -> ForwardInputs:
    """One decode batch: row i generates from token_ids[i] at positions[i] (with the
    adapter in slot adapter_slots[i], LoRA on); `logits`: some row needs its logits (see
    token_generation_bucket); `state` [rows, 2, state layers]: a hybrid model's state
    slots in the block layout (`state_slots`).

    With speculation row i may also accept up to budget[i] drafts (the n-gram drafts
    `drafts[i]` [num_speculative_tokens], negative where there is none; a fused draft
    model proposes its own). The bucket must hold the positions the graph computes past
    each row's: NxDI picks it by the attention mask's length plus speculation_length,
    strictly below the bucket (model_wrapper.get_target_bucket).

    In the contiguous layout a graph of batch b serves cache lines (seq_ids) 0..b-1 only:
    NxDI fills the missing seq_ids of a partial batch from range(b) (model_wrapper.
    _forward_with_pad), so the batch bucket must exceed the largest seq_id, not just
    hold the rows."""
    real = int(token_ids.shape[0])
    width, active = decode_width(settings), decode_active(settings)
    spans = np.zeros(real, dtype=np.int64) if budget is None else np.asarray(budget)
    rows_needed = real if settings.is_block_layout else int(seq_ids.max()) + 1
    need = int(positions.max()) + 1 + settings.speculation_length
    bucket = token_generation_bucket(settings, rows_needed, need, logits)
    if (
        settings.backend == "nxd"
        and settings.is_eagle
        and not settings.is_block_layout
        and (bucket[0] > real)
    ):
        # NxDI's EAGLE decode clips every position to the bucket's length less
        # speculation_length (model_base.py NeuronFusedSpecModel.forward, `torch.clamp(
        # position_ids, ..., max=bucket_size - generation_length)`), which would move a
        # pad row's writes from the last position (nxd/arguments) into cache positions
        # a request outside the batch holds: with pad rows, the largest length, where
        # the last position stays unclipped.
        bucket = token_generation_bucket(
            settings, rows_needed, settings.token_generation_buckets[-1], logits
        )
    rows = bucket[0]
    ids = np.zeros((rows, active), dtype=np.int64)
    ids[:real, 0] = token_ids
    if active > 1 and drafts is not None:
        ids[:real, 1:] = np.maximum(drafts, 0)  # a missing draft is never accepted
    pos = np.zeros((rows, active), dtype=np.int64)
    pos[:real] = positions[:, None] + np.arange(active)
    seq = np.full(rows, PAD_SEQ_ID, dtype=np.int64)
    seq[:real] = seq_ids
    full = np.zeros(rows, dtype=np.int64)
    full[:real] = positions + 1 + spans
    computed = np.zeros(rows, dtype=np.int64)
    computed[:real] = positions
    table = slots = None
    if settings.is_block_layout:
        table = pad_block_tables(block_ids or [], rows, settings.max_blocks_per_seq)
        slots = np.full((rows, width), PAD_SLOT, dtype=np.int64)
        offsets = np.arange(width)[None, :]
        kept = offsets <= spans[:, None]
        written = positions[:, None] + np.minimum(offsets, spans[:, None])
        slots[:real] = np.where(
            kept, slot_mapping(table[:real], written, settings.block_size), PAD_SLOT
        )
    return ForwardInputs(
        phase=TOKEN_GENERATION,
        bucket=bucket,
        input_ids=ids,
        position_ids=pos,
        seq_ids=seq,
        slot_mapping=slots,
        block_table=table,
        full_context_lens=full,
        computed_context_lens=computed,
        num_real=real,
        width=width if width > active else None,
        adapter_slots=_adapter_slots(settings, rows, adapter_slots),
        state_slots=_padded_state(state, rows),
    )


def _padded_state(state: np.ndarray | None, rows: int) -> np.ndarray | None:
    """[rows, 2, state layers]: the given rows' state slots, -1 for the pad rows."""
    if state is None:
        return None
    state = np.asarray(state, dtype=np.int64)
    padded = np.full((rows, *state.shape[1:]), -1, dtype=np.int64)
    padded[: state.shape[0]] = state
    return padded


def padding_inputs(settings: NeuronSettings, phase: str, shape: tuple[int, ...]) -> ForwardInputs:
    """A call of exactly `shape` holding only padding: every write goes to scratch, so
    it runs a graph (warm-up, timing) without touching any request's KV entries."""
    if phase == CONTEXT_ENCODING:
        rows, active = 1, shape[0]
        width = active
    else:
        rows, active = shape[0], decode_active(settings)
        width = decode_width(settings)
    block = settings.is_block_layout
    return ForwardInputs(
        phase=phase,
        bucket=tuple(shape),
        input_ids=np.zeros((rows, active), dtype=np.int64),
        position_ids=np.zeros((rows, active), dtype=np.int64),
        seq_ids=np.full(rows, PAD_SEQ_ID, dtype=np.int64),
        slot_mapping=np.full((rows, width), PAD_SLOT, dtype=np.int64) if block else None,
        block_table=np.zeros((rows, settings.max_blocks_per_seq), dtype=np.int64)
        if block
        else None,
        full_context_lens=np.zeros(rows, dtype=np.int64),
        computed_context_lens=np.zeros(rows, dtype=np.int64),
        num_real=0,
        width=width if width > active else None,
        adapter_slots=_adapter_slots(settings, rows, None),
    )
