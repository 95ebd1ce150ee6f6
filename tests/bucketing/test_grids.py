"""Grid generators and grid validation."""

import math

import pytest
from hypothesis import given, strategies as st

from bucketing.errors import BucketError
from bucketing.grids import (align_up, batch_grid, explicit, geometric, linear, make_grid,
                             nxdi_buckets, nxdi_chunk_sizes, prefix_grid, validate_grid)

# Results of NxDI's autobucketing.generate_buckets(min, max) for these limits, including
# its round(log2(max)) (2500 has no 2048; 1448 has no 1024 but 1449 does), its
# int(log2(min)) (min 200 starts at 128, min 100 at 64) and min == max / min > max.
NXDI_GENERATE_BUCKETS = {
    (128, 2500): [128, 256, 512, 1024, 2500],
    (128, 2048): [128, 256, 512, 1024, 2048],
    (128, 4096): [128, 256, 512, 1024, 2048, 4096],
    (128, 8192): [128, 256, 512, 1024, 2048, 4096, 8192],
    (128, 128): [128],
    (128, 256): [128, 256],
    (128, 180): [180],
    (128, 181): [181],
    (128, 130): [130],
    (128, 200): [128, 200],
    (128, 1000): [128, 256, 512, 1000],
    (128, 1448): [128, 256, 512, 1448],
    (128, 1449): [128, 256, 512, 1024, 1449],
    (128, 3000): [128, 256, 512, 1024, 2048, 3000],
    (128, 6000): [128, 256, 512, 1024, 2048, 4096, 6000],
    (128, 32768): [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
    (128, 23170): [128, 256, 512, 1024, 2048, 4096, 8192, 23170],
    (128, 23171): [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 23171],
    (128, 100000): [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000],
    (200, 1000): [128, 256, 512, 1000],
    (100, 128): [64, 128],
    (127, 4096): [64, 128, 256, 512, 1024, 2048, 4096],
    (129, 4096): [128, 256, 512, 1024, 2048, 4096],
    (512, 2048): [512, 1024, 2048],
    (512, 4096): [512, 1024, 2048, 4096],
    (64, 96): [64, 96],
    (1, 1): [1],
    (1, 2): [1, 2],
    (1, 3): [1, 2, 3],
    (1, 16): [1, 2, 4, 8, 16],
    (32, 33): [33],
    (1000, 1000): [1000],
    (256, 64): [64],
    (600, 256): [256],
}


@pytest.mark.parametrize("limits", sorted(NXDI_GENERATE_BUCKETS))
def test_nxdi_buckets_match_generate_buckets(limits):
    assert nxdi_buckets(*limits) == NXDI_GENERATE_BUCKETS[limits]


def test_the_2500_case_has_no_2048_bucket():
    assert nxdi_buckets(128, 2500) == [128, 256, 512, 1024, 2500]


@given(st.integers(1, 1 << 16), st.integers(2, 1 << 30))
def test_nxdi_buckets_shape(low, high):
    grid = nxdi_buckets(low, high)
    assert grid[-1] == high
    assert grid == sorted(set(grid))
    powers = grid[:-1]
    assert all(p & (p - 1) == 0 for p in powers)
    if powers:
        assert powers[0] == 1 << (low.bit_length() - 1)
        # The last power sits at least sqrt(2) below the maximum (the rounding rule).
        assert powers[-1] * math.sqrt(2) <= high


@pytest.mark.parametrize("args", [(0, 128), (128, 0), (-1, 5), (1.5, 128), (True, 128)])
def test_nxdi_buckets_rejects_non_positive_limits(args):
    with pytest.raises(BucketError, match="positive integer"):
        nxdi_buckets(*args)


def test_geometric_grid():
    assert geometric(128, 2048, 2) == [128, 256, 512, 1024, 2048]
    assert geometric(100, 1000, 1.5) == [100, 150, 225, 338, 507, 760, 1000]
    # 128 * 1.5**2 is 288.00000000000006 in floating point: still 288, not 289.
    assert geometric(128, 300, 1.5) == [128, 192, 288, 300]
    assert geometric(2048, 2048, 1.5) == [2048]
    assert geometric(10, 13, 1.01) == [10, 11, 12, 13]


@pytest.mark.parametrize("ratio", [1, 0.5, -2, "2"])
def test_geometric_rejects_ratios_not_above_one(ratio):
    with pytest.raises(BucketError, match="ratio"):
        geometric(128, 2048, ratio)


def test_linear_grid():
    assert linear(128, 1000, 256) == [128, 384, 640, 896, 1000]
    assert linear(256, 1024, 256) == [256, 512, 768, 1024]
    with pytest.raises(BucketError, match="step"):
        linear(128, 1024, 0)


def test_limits_out_of_order_are_rejected_with_the_fix():
    with pytest.raises(BucketError, match="min_length 4096 is above max_length 2048; lower"):
        linear(4096, 2048, 128)


def test_explicit_sorts_and_deduplicates():
    assert explicit([512, 128, 512, 2048]) == [128, 512, 2048]
    with pytest.raises(BucketError, match="at least one bucket"):
        explicit([])
    with pytest.raises(BucketError, match="bucket must be a positive integer, got 0"):
        explicit([0, 128])


def test_nxdi_chunk_sizes():
    assert nxdi_chunk_sizes(128, 2048) == [128, 1024, 2048]
    assert nxdi_chunk_sizes(128, 300) == [128, 256, 384]
    assert nxdi_chunk_sizes(128, 256) == [128, 256]
    assert nxdi_chunk_sizes(512, 256) == [512]


def test_align_up_rounds_to_block_multiples():
    assert align_up([100, 128, 129, 500], 32) == [128, 160, 512]


def test_make_grid_dispatches_and_aligns():
    assert make_grid("nxdi", min_length=128, max_length=2500) == nxdi_buckets(128, 2500)
    assert make_grid("geometric", min_length=100, max_length=1024, ratio=1.5,
                     align=32) == [128, 160, 256, 352, 512, 768, 1024]
    assert make_grid("linear", min_length=128, max_length=512, step=128) == [128, 256, 384, 512]
    assert make_grid("chunk", max_length=2048, tile=128) == [128, 1024, 2048]
    assert make_grid("explicit", values=[256, 128]) == [128, 256]


@pytest.mark.parametrize("call, message", [
    (lambda: make_grid("nxdi"), "needs max_length"),
    (lambda: make_grid("linear", max_length=512), "needs step; pass --step"),
    (lambda: make_grid("chunk", max_length=512), "needs tile; pass --tile"),
    (lambda: make_grid("explicit"), "needs values"),
    (lambda: make_grid("cubic", max_length=512), "unknown generator 'cubic'; choose one of"),
    (lambda: make_grid("explicit", values=[100], align=32), "not a multiple of 32"),
    (lambda: make_grid("nxdi", max_length=1000, align=32),
     "max_length 1000 is not a multiple of align 32.*use 992 or 1024"),
])
def test_make_grid_errors_name_the_missing_setting(call, message):
    with pytest.raises(BucketError, match=message):
        call()


def test_validate_grid_accepts_a_good_grid():
    assert validate_grid([128, 512, 2048], name="g", maximum=2048, covers=2048,
                         align=128) == (128, 512, 2048)
    # A cap below the maximum is allowed (longer requests are rejected one by one).
    assert validate_grid([128, 512], name="g", maximum=2048) == (128, 512)


@pytest.mark.parametrize("values, kwargs, message", [
    ("128,256", {}, r"ctx must be a list of bucket sizes, got '128,256'"),
    ([], {}, "ctx is empty; list at least one bucket"),
    ([128, 0], {}, "ctx has 0; every bucket must be a whole number >= 1"),
    ([128, 256.5], {}, "ctx has 256.5"),
    ([128, True], {}, "ctx has True"),
    ([128, 128], {}, "ctx lists 128 twice; remove the duplicate"),
    ([512, 128], {}, r"ctx is not sorted \(512 before 128\); write it in increasing order: "
                     r"\[128, 512\]"),
    ([128, 4096], {"maximum": 2048, "limit_name": "max_model_len"},
     "ctx has 4096, above max_model_len 2048; remove buckets above 2048 or raise max_model_len"),
    ([128, 1024], {"covers": 2048},
     "ctx tops out at 1024 but must reach 2048; add a bucket >= 2048"),
    ([128, 100], {}, "not sorted"),
    ([96, 128], {"align": 64}, r"ctx has 96, not a multiple of 64 \(the KV block size\); use 128"),
    ([128], {"align": 0}, "align must be a positive integer"),
])
def test_validate_grid_errors_name_setting_value_and_fix(values, kwargs, message):
    with pytest.raises(BucketError, match=message):
        validate_grid(values, name="ctx", **kwargs)


def test_prefix_grid_includes_prefix_zero_once():
    assert prefix_grid([512, 1024], [1024, 512]) == [
        (512, 0), (512, 512), (512, 1024), (1024, 0), (1024, 512), (1024, 1024)]
    assert prefix_grid([512], [0, 512]) == [(512, 0), (512, 512)]
    with pytest.raises(BucketError, match="prefix length must be a whole number >= 0, got -1"):
        prefix_grid([512], [-1])


def test_batch_grid_crosses_batches_and_lengths():
    assert batch_grid([4, 1], [256, 128]) == [(1, 128), (1, 256), (4, 128), (4, 256)]
