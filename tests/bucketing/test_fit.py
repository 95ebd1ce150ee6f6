"""The fit rule at every boundary, NxDI's strict rule, and the vectorised forms."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from bucketing.cost import LinearQuadraticCost
from bucketing.errors import BucketError, NoFitError
from bucketing.fit import (assign, assign_nd, context_need, decode_need, first_fit, fit_nd,
                           prefix_caching_fit, prefix_caching_need, strict_fit)
from bucketing.grids import batch_grid, prefix_grid

GRID = [128, 256, 512, 1024, 2048]


@pytest.mark.parametrize("index, bucket", list(enumerate(GRID)))
def test_first_fit_at_every_boundary(index, bucket):
    assert first_fit(GRID, bucket - 1) == bucket
    assert first_fit(GRID, bucket) == bucket
    if index + 1 < len(GRID):
        assert first_fit(GRID, bucket + 1) == GRID[index + 1]
    else:
        with pytest.raises(NoFitError):
            first_fit(GRID, bucket + 1)


@pytest.mark.parametrize("index, bucket", list(enumerate(GRID)))
def test_strict_fit_at_every_boundary(index, bucket):
    assert strict_fit(GRID, bucket - 1) == bucket
    last = index + 1 == len(GRID)
    # NxDI sends a need equal to a bucket to the next one, except at the largest.
    assert strict_fit(GRID, bucket) == (bucket if last else GRID[index + 1])
    if last:
        with pytest.raises(NoFitError):
            strict_fit(GRID, bucket + 1)
    else:
        assert strict_fit(GRID, bucket + 1) == GRID[index + 1]


def test_the_256_token_prompt_difference():
    assert first_fit(GRID, 256) == 256
    assert strict_fit(GRID, 256) == 512


def test_strict_fit_scans_in_the_given_order_like_nxdi():
    assert strict_fit([512, 128], 100) == 512


def test_no_fit_error_names_need_largest_and_fix():
    with pytest.raises(NoFitError) as caught:
        first_fit(GRID, 3000, what="context-encoding tokens")
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, BucketError)
    assert (error.need, error.largest) == (3000, 2048)
    assert str(error) == ("no bucket fits 3000 (context-encoding tokens): the largest bucket "
                          "is 2048; add a bucket >= 3000 to the grid, or keep requests at or "
                          "below 2048")


def test_empty_grid_is_a_configuration_error():
    with pytest.raises(BucketError, match="grid for tokens is empty"):
        first_fit([], 5)
    with pytest.raises(BucketError, match="grid for tokens is empty"):
        strict_fit([], 5)
    with pytest.raises(BucketError, match="grid for shape is empty"):
        fit_nd([], (1, 5))


def test_needs_of_each_phase():
    assert context_need(500, 256) == 244
    assert decode_need(99) == 100
    assert decode_need(99, speculation_length=4) == 104
    assert decode_need(np.array([0, 127])).tolist() == [1, 128]
    # Position 127 needs 128 positions: it fits the 128 bucket; position 128 does not.
    assert first_fit(GRID, decode_need(127)) == 128
    assert first_fit(GRID, decode_need(128)) == 256


BATCH_GRID = batch_grid([1, 2, 4], [128, 256, 512])


@pytest.mark.parametrize("batch, length, expected", [
    # Batch dimension at L-1, L, L+1 of each batch bucket (length fixed at 100).
    (1, 100, (1, 128)), (2, 100, (2, 128)), (3, 100, (4, 128)), (4, 100, (4, 128)),
    # Length dimension at L-1, L, L+1 of each length bucket (batch fixed at 2).
    (2, 127, (2, 128)), (2, 128, (2, 128)), (2, 129, (2, 256)),
    (2, 255, (2, 256)), (2, 256, (2, 256)), (2, 257, (2, 512)),
    (2, 511, (2, 512)), (2, 512, (2, 512)),
])
def test_fit_nd_boundaries_in_each_dimension(batch, length, expected):
    assert fit_nd(BATCH_GRID, (batch, length)) == expected


@pytest.mark.parametrize("need, message", [
    ((5, 100), "dimension 0 needs 5 but its largest bucket is 4"),
    ((2, 513), "dimension 1 needs 513 but its largest bucket is 512"),
])
def test_fit_nd_beyond_the_largest_in_a_dimension(need, message):
    with pytest.raises(NoFitError, match=message) as caught:
        fit_nd(BATCH_GRID, need, what="decode (batch, length)")
    assert caught.value.need == need
    assert caught.value.largest == (4, 512)


def test_fit_nd_when_no_single_bucket_covers_both_dimensions():
    with pytest.raises(NoFitError, match="no single bucket is >= the need in every dimension"):
        fit_nd([(1, 512), (4, 128)], (2, 256))


def test_fit_nd_picks_least_cost_under_the_given_model():
    grid = [(128, 1024), (512, 0), (1024, 0)]
    # Default cost (product of dimensions): a prefix-0 shape costs 0 cells.
    assert fit_nd(grid, (100, 0)) == (512, 0)
    # Latency model: 128 active tokens over 1152 positions (14.4 ms) beat 512 active
    # tokens (48.4 ms), so the cost model, not the listing order, decides.
    assert fit_nd(grid, (100, 0), cost=LinearQuadraticCost(layout="active_prefix")) == (128, 1024)
    assert fit_nd(grid, (100, 300)) == (128, 1024)


def test_fit_nd_ties_go_to_the_lexicographically_smallest_shape():
    assert fit_nd([(4, 128), (2, 256)], (1, 100)) == (2, 256)


@pytest.mark.parametrize("active, prefix, expected", [
    (511, 0, (512, 0)), (512, 0, (512, 0)), (513, 0, (1024, 0)),
    (100, 511, (512, 512)), (100, 512, (512, 512)), (100, 513, (512, 1024)),
])
def test_prefix_grid_boundaries(active, prefix, expected):
    grid = prefix_grid([512, 1024], [512, 1024])
    cost = LinearQuadraticCost(layout="active_prefix")
    assert fit_nd(grid, (active, prefix), cost=cost) == expected


def test_fit_nd_rejects_rank_mismatch():
    with pytest.raises(BucketError, match="has 2 dimensions but the need"):
        fit_nd([(1, 128)], (128,))


@given(st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True),
       st.lists(st.integers(0, 80), min_size=1, max_size=30))
def test_vectorised_assign_equals_the_scalar_rules(grid, needs):
    grid = sorted(grid)
    for rule, scalar in (("first_fit", first_fit), ("strict", strict_fit)):
        got = assign(grid, np.array(needs), rule)
        for need, index in zip(needs, got):
            try:
                expected = grid.index(scalar(grid, need))
            except NoFitError:
                expected = -1
            assert index == expected


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 40)), min_size=1, max_size=8,
                unique=True),
       st.lists(st.tuples(st.integers(0, 7), st.integers(0, 45)), min_size=1, max_size=10))
def test_assign_nd_is_the_least_cost_fitting_shape(grid, needs):
    got = assign_nd(grid, needs)
    for need, index in zip(needs, got):
        fitting = [g for g in grid if g[0] >= need[0] and g[1] >= need[1]]
        if not fitting:
            assert index == -1
        else:
            assert grid[index] == min(fitting, key=lambda g: (g[0] * g[1], g))


def test_unknown_rule_is_rejected():
    with pytest.raises(BucketError, match="unknown fit rule 'best'"):
        assign(GRID, np.array([1]), "best")


ACTIVE = [128, 256, 512, 1024]
PREFIXES = [0, 128, 256, 512, 1024]


@pytest.mark.parametrize("active, prefix, expected", [
    # the spare slots of the active bucket take the prefix tail
    (96, 32, (128, 0)), (96, 33, (128, 128)), (40, 96, (128, 128)),
    (100, 640, (128, 1024)), (600, 320, (1024, 0)), (600, 600, (1024, 256)),
    # NxDI's corner: 256 < total <= 512 runs (512, 0)
    (1, 255, (128, 128)), (1, 256, (512, 0)), (200, 312, (512, 0)), (200, 313, (256, 512)),
    (512, 0, (512, 0)),
])
def test_prefix_caching_fit_is_nxdis_choice(active, prefix, expected):
    assert prefix_caching_fit(ACTIVE, PREFIXES, active, prefix) == expected


def test_prefix_caching_corner_needs_a_512_bucket():
    assert prefix_caching_fit([128, 1024], [0, 128, 1024], 200, 100) == (1024, 0)
    assert prefix_caching_fit([128, 1024], [0, 128, 1024], 100, 200) == (128, 1024)


def test_prefix_caching_fit_beyond_the_grid():
    with pytest.raises(NoFitError, match="1025"):
        prefix_caching_fit(ACTIVE, PREFIXES, 1025, 0)
    with pytest.raises(NoFitError, match="prefix_buckets"):
        prefix_caching_fit([128], [0, 128], 100, 200)


def test_prefix_caching_need_of_reachable_and_unreachable_shapes():
    assert prefix_caching_need(ACTIVE, PREFIXES, (512, 0), 2048) == (512, 0)
    assert prefix_caching_need(ACTIVE, PREFIXES, (512, 0), 300) == (300, 0)
    assert prefix_caching_need(ACTIVE, PREFIXES, (128, 128), 2048) == (128, 128)
    assert prefix_caching_need(ACTIVE, PREFIXES, (256, 0), 2048) == (256, 0)
    # every total a (256, p) or (128, 256) shape could serve lies in the corner
    assert prefix_caching_need(ACTIVE, PREFIXES, (256, 128), 2048) is None
    assert prefix_caching_need(ACTIVE, PREFIXES, (128, 256), 2048) is None
    # beyond max_total
    assert prefix_caching_need(ACTIVE, PREFIXES, (1024, 1024), 1024) is None


@given(st.lists(st.sampled_from([16, 32, 64, 100, 128, 256, 300, 512, 640]), min_size=1,
                max_size=4, unique=True),
       st.lists(st.sampled_from([32, 64, 96, 128, 256, 512, 768]), min_size=1, max_size=4,
                unique=True),
       st.integers(2, 900), st.integers(1, 900))
def test_prefix_caching_need_inverts_the_fit(active, prefixes, max_total, new):
    active, prefixes = sorted(active), [0] + sorted(prefixes)
    for shape in [(a, p) for a in active for p in prefixes]:
        need = prefix_caching_need(active, prefixes, shape, max_total)
        if need is not None:
            assert prefix_caching_fit(active, prefixes, *need) == shape
            assert sum(need) <= max_total and need[0] >= 1
    new = min(new, max_total)
    for cached in range(0, max_total - new + 1, 37):
        try:
            shape = prefix_caching_fit(active, prefixes, new, cached)
        except NoFitError:
            continue
        need = prefix_caching_need(active, prefixes, shape, max_total)
        assert need is not None and sum(need) >= new + cached
