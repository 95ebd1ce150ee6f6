"""The NxD forward contract built by `neuron_plugin.core.inputs`, against hand-worked tables."""

from __future__ import annotations

import numpy as np
import pytest

from bucketing.errors import NoFitError
from neuron_plugin.core.settings import EngineLimits, resolve_settings
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    PAD_SEQ_ID,
    PAD_SLOT,
    TOKEN_GENERATION,
    context_encoding_bucket,
    context_encoding_inputs,
    context_encoding_need,
    pad_block_tables,
    slot_mapping,
    token_generation_inputs,
)


def settings(prefix_caching: bool = False, **override):
    limits = EngineLimits(max_model_len=256, max_num_seqs=4,
                          block_size=16 if prefix_caching else None,
                          enable_prefix_caching=prefix_caching, enable_chunked_prefill=False,
                          max_num_batched_tokens=256, dtype="float32")
    return resolve_settings(limits, override, backend="reference",
                            architecture="LlamaForCausalLM")


CONTIGUOUS = dict(context_encoding_buckets=[32, 64, 128],
                  token_generation_buckets=[64, 128, 256],
                  token_generation_batches=[1, 2, 4])


def test_slot_mapping_hand_worked():
    table = np.array([[7, 3, 9]])
    positions = np.array([[0, 15, 16, 17, 33]])
    # block_table[pos // 16] * 16 + pos % 16
    assert slot_mapping(table, positions, 16).tolist() == [[112, 127, 48, 49, 145]]


def test_pad_block_tables_fill_with_null_block():
    table = pad_block_tables([[4, 5], [9]], rows=3, width=4)
    assert table.tolist() == [[4, 5, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="block table has 2 columns"):
        pad_block_tables([[1, 2, 3]], rows=1, width=2)


@pytest.mark.parametrize("length,bucket", [(63, 64), (64, 64), (65, 128), (1, 32), (32, 32),
                                           (33, 64), (127, 128), (128, 128)])
def test_new_prefill_pads_to_first_fit(length, bucket):
    s = settings(**CONTIGUOUS)
    tokens = np.arange(100, 100 + length)
    inputs = context_encoding_inputs(s, tokens, start=0, seq_id=2, block_ids=None)
    assert inputs.phase == CONTEXT_ENCODING
    assert inputs.bucket == (bucket,)
    assert inputs.input_ids.shape == (1, bucket)
    assert inputs.input_ids[0, :length].tolist() == tokens.tolist()
    assert not inputs.input_ids[0, length:].any()
    assert inputs.position_ids[0, :length].tolist() == list(range(length))
    assert inputs.full_context_lens.tolist() == [length]
    assert inputs.computed_context_lens.tolist() == [0]
    assert inputs.seq_ids.tolist() == [2]
    assert inputs.slot_mapping is None and inputs.block_table is None
    assert inputs.real_tokens == length
    assert inputs.padded_tokens == bucket - length


def test_prefill_beyond_largest_bucket_names_need_and_largest():
    s = settings(**CONTIGUOUS)
    with pytest.raises(NoFitError) as info:
        context_encoding_inputs(s, np.arange(129), start=0, seq_id=0, block_ids=None)
    assert "129" in str(info.value) and "128" in str(info.value)


def test_prefix_cache_hit_prefill_block_layout():
    # 40-token prompt, first 32 tokens (two 16-token blocks) served from the cache.
    s = settings(prefix_caching=True, context_encoding_buckets=[16, 32, 64],
                 prefix_buckets=[32, 64, 128, 256])
    blocks = [5, 8, 2]
    context = np.concatenate([np.arange(32), np.arange(500, 508)])  # new: tokens 32..39
    inputs = context_encoding_inputs(s, context, start=32, seq_id=0, block_ids=blocks)
    assert inputs.bucket == (16, 32)  # 8 new tokens -> 16; 32 cached -> prefix 32
    assert inputs.input_ids[0, :8].tolist() == list(range(500, 508))
    assert inputs.context_ids.tolist() == context.tolist()
    assert inputs.position_ids[0, :8].tolist() == list(range(32, 40))
    assert inputs.full_context_lens.tolist() == [40]
    assert inputs.computed_context_lens.tolist() == [32]
    # position 32 -> block_table[2] = 2 -> slots 32..39
    assert inputs.slot_mapping[0, :8].tolist() == list(range(32, 40))
    assert (inputs.slot_mapping[0, 8:] == PAD_SLOT).all()
    assert inputs.block_table.shape == (1, 16)  # ceil(256 / 16)
    assert inputs.block_table[0, :4].tolist() == [5, 8, 2, 0]


def test_prefix_miss_prefill_uses_prefix_zero():
    s = settings(prefix_caching=True, context_encoding_buckets=[16, 32, 64],
                 prefix_buckets=[32, 64, 128, 256])
    inputs = context_encoding_inputs(s, np.arange(20), start=0, seq_id=0, block_ids=[3, 4])
    assert inputs.bucket == (32, 0)
    assert inputs.slot_mapping[0, :20].tolist() == (list(range(48, 64)) + list(range(64, 68)))


def test_chunked_prefill_chunk_contract():
    # Chunk of tokens [48, 80) of a longer prompt: full = 80, computed = 48.
    s = settings(prefix_caching=True, context_encoding_buckets=[16, 32, 64],
                 prefix_buckets=[32, 64, 128, 256])
    inputs = context_encoding_inputs(s, np.arange(80), start=48, seq_id=0,
                                     block_ids=[1, 2, 3, 4, 5])
    assert inputs.input_ids[0].tolist() == list(range(48, 80))
    assert inputs.bucket == (32, 64)
    assert inputs.full_context_lens.tolist() == [80]
    assert inputs.computed_context_lens.tolist() == [48]
    assert inputs.position_ids[0].tolist() == list(range(48, 80))
    assert inputs.slot_mapping[0, 0] == 4 * 16 and inputs.slot_mapping[0, -1] == 5 * 16 + 15


@pytest.mark.parametrize("position,bucket", [(62, 64), (63, 64), (64, 128), (127, 128),
                                             (128, 256), (255, 256)])
def test_decode_context_bucket_boundaries(position, bucket):
    # A decode at position p needs p + 1 positions (full_context_len).
    s = settings(**CONTIGUOUS)
    inputs = token_generation_inputs(s, np.array([42]), np.array([position]),
                                     np.array([0]), None)
    assert inputs.phase == TOKEN_GENERATION
    assert inputs.bucket == (1, bucket)
    assert inputs.full_context_lens.tolist() == [position + 1]
    assert inputs.computed_context_lens.tolist() == [position]


@pytest.mark.parametrize("batch,rows", [(1, 1), (2, 2), (3, 4), (4, 4)])
def test_decode_batch_padding_rows(batch, rows):
    s = settings(**CONTIGUOUS)
    inputs = token_generation_inputs(s, np.arange(10, 10 + batch), np.full(batch, 20),
                                     np.arange(batch)[::-1].copy(), None)
    assert inputs.bucket == (rows, 64)
    assert inputs.num_real == batch
    assert inputs.seq_ids[:batch].tolist() == list(range(batch))[::-1]
    assert (inputs.seq_ids[batch:] == PAD_SEQ_ID).all()
    assert (inputs.full_context_lens[batch:] == 0).all()
    assert inputs.real_tokens == batch
    assert inputs.padded_tokens == rows - batch


@pytest.mark.parametrize("seq_ids,rows", [([0], 1), ([1], 2), ([3], 4), ([1, 0], 2),
                                          ([2, 0], 4)])
def test_contiguous_decode_batch_covers_the_highest_seq_id(seq_ids, rows):
    # A batch bucket b serves cache lines 0..b-1 (NxDI completes seq_ids from range(b)).
    s = settings(**CONTIGUOUS)
    batch = len(seq_ids)
    inputs = token_generation_inputs(s, np.arange(batch), np.full(batch, 20),
                                     np.array(seq_ids), None)
    assert inputs.bucket == (rows, 64) and inputs.num_real == batch


def test_decode_block_layout_slots_and_tables():
    s = settings(prefix_caching=True, token_generation_buckets=[64, 128, 256])
    inputs = token_generation_inputs(s, np.array([7, 8, 9]), np.array([16, 40, 1]),
                                     np.array([0, 1, 2]), [[3, 6], [1, 2, 9], [4]])
    assert inputs.bucket == (4, 64)  # the default decode batches are 1, 2 and 4 rows
    assert inputs.slot_mapping[:3, 0].tolist() == [6 * 16 + 0, 9 * 16 + 8, 4 * 16 + 1]
    assert (inputs.slot_mapping[3:] == PAD_SLOT).all()
    assert inputs.block_table[3:].sum() == 0


def test_prefill_vectorised_cost_independent_of_max_model_len():
    """No per-position Python loop: inputs for a 16-token prompt are built the same way
    (and with the same array sizes) whatever max_model_len is."""
    small = settings(**CONTIGUOUS)
    limits = EngineLimits(max_model_len=32768, max_num_seqs=4, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=32768, dtype="float32")
    large = resolve_settings(limits, {"context_encoding_buckets": [32, 32768]},
                             backend="reference", architecture="LlamaForCausalLM")
    a = context_encoding_inputs(small, np.arange(16), 0, 0, None)
    b = context_encoding_inputs(large, np.arange(16), 0, 0, None)
    assert a.input_ids.shape == b.input_ids.shape == (1, 32)


def test_one_token_block_prompt_is_a_decode():
    # NxDI routes a block-layout call with one input token to token generation.
    s = settings(prefix_caching=True, token_generation_buckets=[64, 128, 256])
    inputs = context_encoding_inputs(s, np.array([42]), start=0, seq_id=2, block_ids=[7])
    assert inputs.phase == TOKEN_GENERATION and inputs.bucket == (1, 64)
    assert inputs.num_real == 1 and inputs.seq_ids[0] == 2
    assert inputs.full_context_lens[0] == 1 and inputs.computed_context_lens[0] == 0
    assert inputs.slot_mapping[0, 0] == 7 * 16
    contiguous = context_encoding_inputs(settings(**CONTIGUOUS), np.array([42]), 0, 2, None)
    assert contiguous.phase == CONTEXT_ENCODING


@pytest.mark.parametrize("new,cached,bucket", [
    (96, 32, (128, 0)),      # spare active slots re-encode the whole prefix
    (40, 96, (128, 128)),
    (200, 56, (256, 0)),     # total 256: not yet the corner
    (200, 57, (512, 0)),     # 257..512 tokens run (512, 0)
    (300, 0, (512, 0)),
    (100, 640, (128, 1024)),
])
def test_block_prefill_runs_nxdis_bucket(new, cached, bucket):
    limits = EngineLimits(max_model_len=1024, max_num_seqs=4, block_size=16,
                          enable_prefix_caching=True, enable_chunked_prefill=False,
                          max_num_batched_tokens=1024, dtype="float32")
    s = resolve_settings(limits, {}, backend="reference", architecture="LlamaForCausalLM")
    assert context_encoding_bucket(s, new, cached) == bucket
    assert bucket in s.context_encoding_shapes()


def test_context_encoding_need_runs_its_shape():
    s = settings(prefix_caching=True, context_encoding_buckets=[16, 32, 64],
                 prefix_buckets=[32, 64, 128, 256])
    for shape in s.context_encoding_shapes():
        new, cached = context_encoding_need(s, shape)
        assert context_encoding_bucket(s, new, cached) == shape
        assert new + cached <= s.max_model_len
    assert context_encoding_need(settings(**CONTIGUOUS), (64,)) == (64, 0)
    defaults = settings(prefix_caching=True)
    assert defaults.context_encoding_shapes() == [(128, 0), (128, 128), (256, 0)]
    with pytest.raises(ValueError, match=r"graph \(256, 128\)"):
        context_encoding_need(defaults, (256, 128))  # 257+ tokens exceed max_model_len
