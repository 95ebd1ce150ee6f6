"""Choosing a grid from a workload: the grid of at most K buckets with least expected cost.

1-D (exact). Sort the distinct needs; a grid splits them into consecutive groups, each
served by a bucket. When cost does not decrease with length, the best bucket for a group
is its largest need (rounded up to ``align``), so candidates are the distinct needs plus
the maximum, and dynamic programming over "last bucket at candidate i, using k buckets"
finds the optimum in O(K * n^2) (vectorised with numpy). The largest bucket is always
``maximum`` (max_model_len), so every request that the server accepts fits; needs above
``maximum`` are left out (the server rejects them) and reports count them.

2-D (documented heuristic). A 2-D grid is a cross product of two 1-D grids, e.g.
(batch, context length) or (active tokens, prefix length). Holding one dimension fixed,
the other is again an exact 1-D problem: each need's class is the bucket it gets in the
fixed dimension, and a group's cost sums its classes' costs. ``tune_2d`` alternates these
exact solves from a one-bucket start until a round no longer lowers the expected cost
(block coordinate descent). Each step never raises the cost, so it terminates at a grid
that no change of a single dimension can improve; that is not proven globally optimal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .cost import DEFAULT_COST, CostModel, LinearQuadraticCost
from .errors import BucketError
from .grids import validate_grid
from .workload import Histogram, Workload, WorkloadLike, as_workload, context_needs

PAIRS = ("batch", "prefix")
BLOCK = 512  # candidate rows per vectorised DP block: bounds memory to BLOCK * n floats


def as_histogram(data: WorkloadLike) -> Histogram:
    """A Histogram from a Histogram, a Workload (its context needs), a {length: count}
    mapping or a list of lengths."""
    if isinstance(data, Histogram):
        return data
    workload = data if isinstance(data, Workload) else as_workload(data)
    return context_needs(workload)


def buckets_within_budget(budget_s: float, seconds_per_graph: float) -> int:
    """How many graphs a compile-time budget pays for, at a measured time per graph."""
    if not seconds_per_graph > 0 or not budget_s > 0:
        raise BucketError(
            f"compile budget {budget_s!r} s and seconds per graph "
            f"{seconds_per_graph!r} must both be > 0"
        )
    graphs = int(budget_s // seconds_per_graph)
    if graphs < 1:
        raise BucketError(
            f"a compile budget of {budget_s} s does not pay for one graph at "
            f"{seconds_per_graph} s each; raise the budget"
        )
    return graphs


def tune_1d(
    lengths_or_histogram: WorkloadLike,
    max_buckets: int,
    *,
    maximum: int,
    cost: CostModel | None = None,
    align: int | None = None,
) -> list[int]:
    """The grid of at most ``max_buckets`` buckets, the largest = ``maximum``, with least
    expected cost under first fit (exact; see the module docstring)."""
    hist = as_histogram(lengths_or_histogram)
    _check_limits("max_buckets", max_buckets, "maximum", maximum, align)
    candidates, counts = _candidates(hist.values, hist.counts, maximum, align, floor=1)
    prices = (cost or DEFAULT_COST).costs(candidates[:, None])
    chosen = _solve(counts[:, None], prices[:, None], max_buckets, forced=())
    return [int(candidates[i]) for i in chosen]


def tune_2d(
    needs: np.ndarray,
    counts: np.ndarray,
    max_buckets: tuple[int, int],
    *,
    maxima: tuple[int, int],
    pair: str = "batch",
    cost: CostModel | None = None,
    align: tuple[int | None, int | None] = (None, None),
    max_graphs: int | None = None,
) -> tuple[list[int], list[int]]:
    """Two 1-D grids whose cross product serves the 2-D ``needs`` (rows, with ``counts``)
    at least expected cost, each at most ``max_buckets[d]`` long and topped by
    ``maxima[d]``; at most ``max_graphs`` shapes in the product when given.

    pair "batch": rows are (batch, length). pair "prefix": rows are (active tokens,
    prefix length); prefix 0 is always a bucket (a cache miss) and counts toward K.
    """
    if pair not in PAIRS:
        raise BucketError(f"unknown pair {pair!r}; choose one of {', '.join(PAIRS)}")
    needs = np.asarray(needs, dtype=np.int64).reshape(-1, 2)
    counts = np.asarray(counts, dtype=np.int64)
    for axis in (0, 1):
        _check_limits(
            f"max_buckets[{axis}]", max_buckets[axis], f"maxima[{axis}]", maxima[axis], align[axis]
        )
    if cost is None:
        cost = LinearQuadraticCost(layout="active_prefix") if pair == "prefix" else DEFAULT_COST
    served = np.all(needs <= np.asarray(maxima), axis=1)
    if not served.any():
        raise BucketError(f"every need exceeds the maxima {maxima}; raise them")
    needs, counts = needs[served], counts[served]
    floors = (1, 0 if pair == "prefix" else 1)
    axes = [
        _candidates(
            needs[:, axis],
            counts,
            maxima[axis],
            align[axis],
            floors[axis],
            extra=(0,) if floors[axis] == 0 else (),
        )[0]
        for axis in (0, 1)
    ]
    index = np.stack(
        [np.searchsorted(axes[axis], np.maximum(needs[:, axis], floors[axis])) for axis in (0, 1)],
        axis=1,
    )
    forced = [(), (0,) if pair == "prefix" else ()]
    first, *others = _bucket_splits(max_buckets, max_graphs, len(forced[1]) + 1)
    best = _coordinate_descent(axes, index, counts, cost, first, forced)
    for limits in others:
        grids = _coordinate_descent(axes, index, counts, cost, limits, forced)
        if grids[0] < best[0] - 1e-9 * max(1.0, abs(best[0])):
            best = grids
    return [int(v) for v in axes[0][best[1][0]]], [int(v) for v in axes[1][best[1][1]]]


def _bucket_splits(
    max_buckets: tuple[int, int], max_graphs: int | None, least_second: int
) -> list[tuple[int, int]]:
    """(K0, K1) limits to try: the caps themselves, or under a graph budget each K0 up to
    its cap with the largest K1 the budget leaves."""
    if max_graphs is None:
        return [(max_buckets[0], max_buckets[1])]
    splits = [
        (a, min(max_buckets[1], max_graphs // a))
        for a in range(1, max_buckets[0] + 1)
        if max_graphs // a >= least_second
    ]
    if not splits:
        raise BucketError(
            f"a budget of {max_graphs} graphs cannot hold the forced buckets; "
            f"raise the compile budget"
        )
    return splits


def _coordinate_descent(axes, index, counts, cost, limits, forced):
    """Alternate exact 1-D solves (see module docstring); returns (cost, chosen indices)."""
    chosen = [
        np.array(sorted(set(forced[0]) | {len(axes[0]) - 1})),
        np.array(sorted(set(forced[1]) | {len(axes[1]) - 1})),
    ]
    total = np.inf
    while True:
        for axis in (0, 1):
            other = 1 - axis
            # Class of each need in the fixed dimension: its first-fit bucket there.
            klass = np.searchsorted(chosen[other], index[:, other])
            sizes = axes[other][chosen[other]]
            grid_counts = np.zeros((len(axes[axis]), len(sizes)), dtype=np.int64)
            np.add.at(grid_counts, (index[:, axis], klass), counts)
            shapes = np.empty((len(axes[axis]), len(sizes), 2), dtype=np.int64)
            shapes[:, :, axis] = axes[axis][:, None]
            shapes[:, :, other] = sizes[None, :]
            prices = cost.costs(shapes.reshape(-1, 2)).reshape(len(axes[axis]), len(sizes))
            chosen[axis] = np.array(_solve(grid_counts, prices, limits[axis], forced[axis]))
        new_total = _expected(axes, chosen, index, counts, cost)
        if not new_total < total - 1e-9 * max(1.0, abs(new_total)):
            return min(total, new_total), chosen
        total = new_total


def _expected(axes, chosen, index, counts, cost) -> float:
    """Total cost of the cross-product grid ``chosen`` over all needs."""
    shapes = np.stack(
        [
            axes[axis][chosen[axis]][np.searchsorted(chosen[axis], index[:, axis])]
            for axis in (0, 1)
        ],
        axis=1,
    )
    return float(np.dot(cost.costs(shapes), counts))


def _check_limits(k_name: str, k: int, max_name: str, maximum: int, align: int | None) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise BucketError(f"{k_name} must be a whole number >= 1, got {k!r}")
    validate_grid([maximum], name=max_name, align=align)


def _candidates(
    values: np.ndarray,
    counts: np.ndarray,
    maximum: int,
    align: int | None,
    floor: int,
    extra: Sequence[int] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """Candidate bucket sizes (needs raised to ``floor``, rounded up to ``align``, plus
    ``maximum`` and ``extra``) and the count of needs whose own candidate each is.
    Needs above ``maximum`` are dropped."""
    values = np.asarray(values, dtype=np.int64)
    keep = values <= maximum
    if not keep.any():
        raise BucketError(
            f"every need exceeds maximum {maximum}; raise the maximum "
            f"(max_model_len) or check the trace"
        )
    values = np.maximum(values[keep], floor)
    if align:
        values = -(-values // align) * align
    candidates = np.unique(np.concatenate([values, [maximum], np.asarray(extra, np.int64)]))
    per_candidate = np.bincount(
        np.searchsorted(candidates, values), weights=counts[keep], minlength=len(candidates)
    )
    return candidates, per_candidate


def _solve(
    counts: np.ndarray, prices: np.ndarray, max_buckets: int, forced: Sequence[int]
) -> list[int]:
    """Indices of the least-cost set of at most ``max_buckets`` candidates that includes
    the last candidate and every ``forced`` one.

    counts[i, c]: weight of needs of class c whose own candidate is i; prices[i, c]: cost
    of one class-c need in bucket i. A bucket at i serves the needs of candidates j..i
    (j just after the previous bucket), costing sum_c (P[i+1, c] - P[j, c]) * prices[i, c]
    with P the prefix sums of counts.
    """
    m = counts.shape[0]
    if max_buckets < len(set(forced) | {m - 1}):
        raise BucketError(
            f"max_buckets {max_buckets} cannot hold the {len(set(forced) | {m - 1})} "
            f"buckets that must exist (the maximum and prefix 0); raise it"
        )
    prefix = np.vstack([np.zeros((1, counts.shape[1])), np.cumsum(counts, axis=0)])
    # The previous bucket may not lie before a forced candidate the new one would skip.
    # (-1 stands first so that "no forced candidate before" maps to 0.)
    forced_sorted = np.array([-1, *sorted(forced)], dtype=np.int64)
    ends = np.arange(1, m + 1)
    lowest = forced_sorted[np.searchsorted(forced_sorted, ends - 1) - 1] + 1
    previous = np.full(m + 1, np.inf)
    previous[0] = 0.0
    parents = np.zeros((max_buckets, m + 1), dtype=np.int64)
    best_total, best_k = np.inf, 0
    for k in range(1, max_buckets + 1):
        current = np.full(m + 1, np.inf)
        for start in range(0, m, BLOCK):
            block = ends[start : start + BLOCK]  # prefix positions i (bucket = candidate i-1)
            top = int(block[-1])
            starts = np.arange(top)[:, None]
            price = prices[block - 1]  # (block, classes)
            options = previous[:top, None] - prefix[:top] @ price.T
            options[(starts >= block[None, :]) | (starts < lowest[block - 1][None, :])] = np.inf
            pick = np.argmin(options, axis=0)
            current[block] = options[pick, np.arange(len(block))] + np.einsum(
                "ij,ij->i", prefix[block], price
            )
            parents[k - 1, block] = pick
        total = float(current[m])
        if np.isfinite(total) and total < best_total - 1e-9 * max(1.0, total):
            best_total, best_k = total, k
        previous = current
    if not np.isfinite(best_total):
        raise BucketError("no grid within max_buckets serves the workload; raise max_buckets")
    chosen, position = [], m
    for k in range(best_k, 0, -1):
        chosen.append(position - 1)
        position = int(parents[k - 1, position])
    return sorted(chosen)
