"""The tuner: exact against brute force, monotone in K, at realistic sizes, and its figure on
real traffic."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bucketing.cost import DEFAULT_COST, LinearQuadraticCost, PaddedTokenCost, TableCost
from bucketing.errors import BucketError
from bucketing.grids import batch_grid, prefix_grid
from bucketing.report import nxdi_default_grid, report_1d, report_2d
from bucketing.trace import read_lengths
from bucketing.tune import as_histogram, buckets_within_budget, tune_1d, tune_2d
from bucketing.workload import context_needs
from tests.bucketing import AZURE

COSTS = [PaddedTokenCost(), DEFAULT_COST]


def expected_cost(grid, lengths, cost):
    grid = np.asarray(grid)
    buckets = grid[np.searchsorted(grid, np.asarray(lengths))]
    return float(cost.costs(buckets[:, None]).sum())


def brute_force(lengths, max_buckets, maximum, cost, align=1):
    """Least cost over every grid of <= K buckets drawn from all sizes 1..maximum (multiples
    of align) that ends at maximum."""
    sizes = range(align, maximum, align)
    return min(expected_cost(list(subset) + [maximum], lengths, cost)
               for k in range(max_buckets) for subset in itertools.combinations(sizes, k))


workloads = st.tuples(st.integers(1, 14), st.integers(1, 4)).flatmap(
    lambda mk: st.tuples(st.lists(st.integers(1, mk[0]), min_size=1, max_size=9),
                         st.just(mk[1]), st.just(mk[0]), st.sampled_from(COSTS)))


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_tune_1d_equals_brute_force_over_all_k_subsets(case):
    lengths, max_buckets, maximum, cost = case
    grid = tune_1d(lengths, max_buckets, maximum=maximum, cost=cost)
    assert grid == sorted(set(grid)) and grid[-1] == maximum and len(grid) <= max_buckets
    assert expected_cost(grid, lengths, cost) == pytest.approx(
        brute_force(lengths, max_buckets, maximum, cost))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 24), min_size=1, max_size=8), st.integers(1, 3))
def test_aligned_tuning_equals_brute_force_over_aligned_grids(lengths, max_buckets):
    grid = tune_1d(lengths, max_buckets, maximum=24, cost=PaddedTokenCost(), align=4)
    assert all(b % 4 == 0 for b in grid)
    assert expected_cost(grid, lengths, PaddedTokenCost()) == pytest.approx(
        brute_force(lengths, max_buckets, 24, PaddedTokenCost(), align=4))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 7),
       st.sampled_from(COSTS))
def test_adding_a_bucket_never_raises_the_expected_cost(lengths, max_buckets, cost):
    fewer = tune_1d(lengths, max_buckets, maximum=300, cost=cost)
    more = tune_1d(lengths, max_buckets + 1, maximum=300, cost=cost)
    assert expected_cost(more, lengths, cost) <= expected_cost(fewer, lengths, cost) + 1e-9


def test_needs_above_the_maximum_are_left_out():
    assert tune_1d([10, 20, 5000], 2, maximum=100, cost=PaddedTokenCost()) == [20, 100]
    with pytest.raises(BucketError, match="every need exceeds maximum 100"):
        tune_1d([5000], 2, maximum=100)


def test_fewest_buckets_win_ties():
    # One distinct length: a second bucket cannot help, so none is added.
    assert tune_1d([100] * 5, 6, maximum=2048) == [100, 2048]
    assert tune_1d([2048], 6, maximum=2048) == [2048]


def test_a_histogram_mapping_and_a_workload_are_accepted():
    assert tune_1d({100: 3, 900: 1}, 3, maximum=1024) == [100, 900, 1024]
    workload = read_lengths(AZURE)
    assert tune_1d(workload, 2, maximum=4096) == tune_1d(context_needs(workload), 2,
                                                        maximum=4096)


def test_a_measured_table_steers_the_tuner():
    # Measured: everything up to 512 costs the same, so a 256 bucket buys nothing.
    table = TableCost(phase="context_encoding", table={(128,): 10.0, (512,): 10.0,
                                                       (2048,): 100.0})
    assert tune_1d([200, 250, 300, 2048], 3, maximum=2048, cost=table) == [300, 2048]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_buckets": 0}, "max_buckets must be a whole number >= 1"),
    ({"maximum": 0}, "maximum has 0"),
    ({"maximum": 1000, "align": 32}, "maximum has 1000, not a multiple of 32"),
])
def test_impossible_limits_are_rejected(kwargs, message):
    args = {"max_buckets": 3, "maximum": 1024, **kwargs}
    with pytest.raises(BucketError, match=message):
        tune_1d([100], args.pop("max_buckets"), **args)


def test_compile_budget():
    assert buckets_within_budget(3600, 600) == 6
    with pytest.raises(BucketError, match="does not pay for one graph"):
        buckets_within_budget(100, 600)
    with pytest.raises(BucketError, match="must both be > 0"):
        buckets_within_budget(100, 0)


def test_ten_thousand_lengths_with_k6_give_six_buckets_that_beat_nxdis_default():
    """At a realistic size (its time: scripts/bench_tune.py, docs/benchmarks.md), six
    increasing buckets ending at the maximum that pad less than NxDI's six."""
    lengths = np.random.default_rng(0).integers(1, 4097, size=10_000)
    hist = as_histogram(lengths)
    grid = tune_1d(hist, 6, maximum=4096)
    assert len(grid) == 6 and grid[-1] == 4096 and grid == sorted(set(grid))
    tuned = report_1d(grid, hist)
    nxdi = report_1d(nxdi_default_grid(4096), hist)
    assert tuned.rejected == nxdi.rejected == 0
    assert tuned.padded_tokens < nxdi.padded_tokens


def test_azure_trace_tuned_six_buckets_pad_a_third_of_nxdi_default():
    hist = as_histogram(read_lengths(AZURE))
    tuned = report_1d(tune_1d(hist, 6, maximum=4096), hist)
    nxdi = report_1d(nxdi_default_grid(4096), hist)
    assert nxdi.grid == [128, 256, 512, 1024, 2048, 4096]
    assert (tuned.padded_tokens, nxdi.padded_tokens) == (2_762_754, 8_296_833)
    assert tuned.padded_tokens / nxdi.padded_tokens == pytest.approx(1 / 3, abs=0.01)
    assert tuned.rejected == nxdi.rejected == 402


def cross_cost(grids, needs, counts, cost):
    shapes = np.stack([np.asarray(g)[np.searchsorted(g, needs[:, axis])]
                       for axis, g in enumerate(grids)], axis=1)
    return float(np.dot(cost.costs(shapes), counts))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 10)), min_size=1, max_size=8))
def test_tune_2d_is_optimal_in_each_dimension_given_the_other(rows):
    needs = np.array(rows)
    counts = np.ones(len(rows), dtype=np.int64)
    batches, lengths = tune_2d(needs, counts, (2, 3), maxima=(4, 10), pair="batch")
    found = cross_cost([batches, lengths], needs, counts, DEFAULT_COST)
    for k in range(2):
        for subset in itertools.combinations(range(1, 4), k):
            other = cross_cost([list(subset) + [4], lengths], needs, counts, DEFAULT_COST)
            assert found <= other + 1e-9
    for k in range(3):
        for subset in itertools.combinations(range(1, 10), k):
            other = cross_cost([batches, list(subset) + [10]], needs, counts, DEFAULT_COST)
            assert found <= other + 1e-9


def test_tune_2d_prefix_keeps_prefix_zero_and_beats_nxdi_default():
    rng = np.random.default_rng(1)
    hits = rng.choice([0, 0, 512, 1024], size=400)
    active = rng.integers(20, 400, size=400)
    needs = np.stack([active, hits], axis=1)
    counts = np.ones(400, dtype=np.int64)
    actives, prefixes = tune_2d(needs, counts, (3, 3), maxima=(2048, 2048), pair="prefix",
                                align=(32, 32))
    assert prefixes[0] == 0 and len(prefixes) <= 3 and actives[-1] == 2048
    assert all(v % 32 == 0 for v in actives + prefixes)
    tuned = report_2d(prefix_grid(actives, prefixes), needs, counts, pair="prefix")
    nxdi = report_2d(prefix_grid([512, 1024, 2048], [512, 1024, 2048]), needs, counts,
                     pair="prefix")
    assert tuned.expected_cost < nxdi.expected_cost


def test_tune_2d_respects_a_graph_budget():
    rng = np.random.default_rng(2)
    needs = np.stack([rng.integers(1, 9, 300), rng.integers(1, 2049, 300)], axis=1)
    counts = np.ones(300, dtype=np.int64)
    batches, lengths = tune_2d(needs, counts, (4, 6), maxima=(8, 2048), max_graphs=6)
    assert len(batches) * len(lengths) <= 6
    unlimited = tune_2d(needs, counts, (4, 6), maxima=(8, 2048))
    assert len(unlimited[0]) * len(unlimited[1]) > 6
    tuned = report_2d(batch_grid(*unlimited), needs, counts)
    budget = report_2d(batch_grid(batches, lengths), needs, counts)
    assert tuned.expected_cost <= budget.expected_cost
    with pytest.raises(BucketError, match="unknown pair 'rows'"):
        tune_2d(needs, counts, (1, 1), maxima=(8, 2048), pair="rows")
    with pytest.raises(BucketError, match="every need exceeds the maxima"):
        tune_2d(needs, counts, (1, 1), maxima=(0 + 1, 1))
    with pytest.raises(BucketError, match="cannot hold the forced buckets"):
        tune_2d(needs, counts, (2, 2), maxima=(8, 2048), pair="prefix", max_graphs=1)


def test_default_2d_cost_follows_the_pair():
    needs, counts = np.array([[100, 512]]), np.array([1])
    assert report_2d([(128, 512)], needs, counts, pair="prefix").cost_model == \
        LinearQuadraticCost(layout="active_prefix").describe()
