"""The fit rule: which compiled bucket serves a need.

This project's rule: a bucket fits when it is >= the need in every dimension; among the
fitting buckets the least costly wins (for a 1-D grid: the smallest). What a phase needs:

- context encoding: the tokens to compute (prompt tokens minus a prefix-cache hit);
- token generation: ``full_context_len`` positions, i.e. position + 1, plus the
  speculation length when speculating.

NxDI's own rule (``strict_fit``) is kept for comparison: it picks the first bucket
strictly greater than the need and uses the largest bucket only when the need equals
it, so a 256-token prompt goes to the 512 bucket of [128, 256, 512] and pads 256 tokens
for nothing.

NxDI's prefix-caching context encoding has a rule of its own (``prefix_caching_fit``),
which a caller of NxDI cannot change: it moves the tail of the cached prefix into the
spare slots of the active bucket, and sends every context of 257-512 tokens to the
(512, 0) graph. ``prefix_caching_need`` inverts it, so the shapes NxDI can run (and a
need that runs each one) are known without NxDI.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, overload

import numpy as np

from .errors import BucketError, NoFitError

RULES = ("first_fit", "strict")
# NxDI model_wrapper.get_target_2d_bucket_for_prefix_caching (0.7-0.9 alike): a context
# of CORNER_LOW < total <= CORNER_HIGH tokens runs the (CORNER_HIGH, 0) graph when the
# active grid has CORNER_HIGH ("based on perf collection results").
CORNER_LOW, CORNER_HIGH = 256, 512


@overload
def context_need(prompt_tokens: int, computed_tokens: int = 0) -> int: ...
@overload
def context_need(
    prompt_tokens: np.ndarray, computed_tokens: int | np.ndarray = 0
) -> np.ndarray: ...
@overload
def context_need(prompt_tokens: int, computed_tokens: np.ndarray) -> np.ndarray: ...
def context_need(
    prompt_tokens: int | np.ndarray, computed_tokens: int | np.ndarray = 0
) -> int | np.ndarray:
    """Tokens a context encoding computes: the prompt minus the prefix already cached.
    Works on ints and numpy arrays alike."""
    return prompt_tokens - computed_tokens


@overload
def decode_need(position: int, speculation_length: int = 0) -> int: ...
@overload
def decode_need(position: np.ndarray, speculation_length: int = 0) -> np.ndarray: ...
def decode_need(position: int | np.ndarray, speculation_length: int = 0) -> int | np.ndarray:
    """Positions a token-generation step attends: ``full_context_len`` = position + 1,
    plus the speculated tokens. Works on ints and numpy arrays alike."""
    return position + 1 + speculation_length


def first_fit(grid: Sequence[int], need: int, *, what: str = "tokens") -> int:
    """The smallest bucket >= need; NoFitError (naming need and largest) when none is."""
    fitting = [bucket for bucket in grid if bucket >= need]
    if not fitting:
        raise NoFitError(need, _largest(grid, what), what)
    return min(fitting)


def strict_fit(grid: Sequence[int], need: int, *, what: str = "tokens") -> int:
    """NxDI's ``get_target_bucket`` first_fit, exactly: scan the grid in order and take the
    first bucket with need < bucket; if none, the last bucket when need equals it; else
    fail (NxDI fails unless allow_input_truncation, which this library never assumes)."""
    for bucket in grid:
        if need < bucket:
            return bucket
    if need == _largest(grid, what) == grid[-1]:
        return grid[-1]
    raise NoFitError(need, max(grid), what)


def _largest(grid: Sequence[int], what: str) -> int:
    if not grid:
        raise BucketError(f"the grid for {what} is empty; configure at least one bucket")
    return max(grid)


def fit_nd(
    grid: Sequence[tuple[int, ...]],
    need: tuple[int, ...],
    *,
    cost: Callable[[tuple[int, ...]], float] | None = None,
    what: str = "shape",
) -> tuple[int, ...]:
    """The least-cost bucket that is >= need in every dimension.

    ``cost`` maps a shape to a number (a ``cost.CostModel`` is callable); the default is
    the product of the dimensions (padded cells). Ties go to the lexicographically
    smallest shape, so the choice is deterministic.
    """
    need = tuple(need)
    if not grid:
        raise BucketError(f"the grid for {what} is empty; configure at least one bucket")
    index = int(assign_nd(grid, [need], cost=cost)[0])
    if index < 0:
        largest = tuple(max(column) for column in zip(*grid, strict=True))
        raise NoFitError(need, largest, what)
    return tuple(grid[index])


def assign_nd(
    grid: Sequence[tuple[int, ...]],
    needs: Sequence[Sequence[int]] | np.ndarray,
    cost: Callable[[tuple[int, ...]], float] | None = None,
) -> np.ndarray:
    """Vectorised N-D fit: for each row of ``needs`` the index into ``grid`` of its
    least-cost fitting bucket (ties: lexicographically smallest), or -1."""
    needs = np.atleast_2d(np.asarray(needs, dtype=np.int64))
    for bucket in grid:
        if len(bucket) != needs.shape[1]:
            raise BucketError(
                f"bucket {tuple(bucket)} has {len(bucket)} dimensions but the "
                f"need {tuple(needs[0].tolist())} has {needs.shape[1]}; use a "
                f"grid of the need's rank"
            )
    shapes = np.asarray(grid, dtype=np.int64)
    price = cost or math.prod
    order = sorted(
        range(len(shapes)),
        key=lambda i: (price(tuple(int(v) for v in shapes[i])), tuple(shapes[i])),
    )
    ranked = shapes[order]
    fits = np.all(ranked[None, :, :] >= needs[:, None, :], axis=2)
    first = np.argmax(fits, axis=1)
    return np.where(fits.any(axis=1), np.asarray(order)[first], -1)


def assign(grid: Sequence[int], needs: np.ndarray, rule: str = "first_fit") -> np.ndarray:
    """Vectorised 1-D fit for a whole workload: the index into the sorted ``grid`` of each
    need's bucket under ``rule``, or -1 where no bucket fits."""
    if rule not in RULES:
        raise BucketError(f"unknown fit rule {rule!r}; choose one of {', '.join(RULES)}")
    edges = np.asarray(grid, dtype=np.int64)
    needs = np.asarray(needs, dtype=np.int64)
    side: Literal["left", "right"] = "left" if rule == "first_fit" else "right"
    index = np.searchsorted(edges, needs, side=side)
    if rule == "strict":
        index = np.where((index == len(edges)) & (needs == edges[-1]), len(edges) - 1, index)
    return np.where(index < len(edges), index, -1)


def _corner(active_grid: Sequence[int], total: int) -> bool:
    return CORNER_HIGH in active_grid and CORNER_LOW < total <= CORNER_HIGH


def prefix_caching_fit(
    active_grid: Sequence[int], prefix_grid: Sequence[int], active: int, prefix: int
) -> tuple[int, int]:
    """NxDI's (active, prefix) graph for ``active`` new tokens after ``prefix`` cached
    ones (prefix caching context encoding; both grids sorted, ``prefix_grid`` with 0).

    The active bucket is the first >= ``active``; its spare slots re-encode the tail of
    the prefix, so the prefix bucket need only hold ``prefix - spare`` tokens; a total of
    257-512 tokens goes to (512, 0) when 512 is an active bucket. NoFitError when the
    active tokens or the remaining prefix exceed the largest bucket."""
    if _corner(active_grid, active + prefix):
        return CORNER_HIGH, 0
    bucket = first_fit(active_grid, active, what="context-encoding bucket (new tokens)")
    rest = max(0, prefix - (bucket - active))
    return bucket, first_fit(
        prefix_grid, rest, what="prefix_buckets (cached prefix beyond the spare slots)"
    )


def prefix_caching_need(
    active_grid: Sequence[int], prefix_grid: Sequence[int], shape: tuple[int, int], max_total: int
) -> tuple[int, int] | None:
    """The longest (active, prefix) need of at most ``max_total`` tokens that
    ``prefix_caching_fit`` sends to ``shape``, or None when no need reaches it (NxDI
    compiles such a graph but never runs it).

    Shape (a, 0) serves totals in (previous active bucket, a]; shape (a, p > 0) serves
    totals in (a + previous prefix bucket, a + p], as `a` new tokens after `total - a`
    cached ones; totals of the corner go to (512, 0) instead."""
    active, prefix = shape
    i, j = list(active_grid).index(active), list(prefix_grid).index(prefix)
    if shape == (CORNER_HIGH, 0) and _corner(active_grid, min(CORNER_HIGH, max_total)):
        return min(CORNER_HIGH, max_total), 0
    if j == 0:
        low, high = (active_grid[i - 1] if i else 0), min(active, max_total)
    else:
        low, high = active + prefix_grid[j - 1], min(active + prefix, max_total)
    if _corner(active_grid, high):
        high = CORNER_LOW
    if high <= low:
        return None
    return (high, 0) if j == 0 else (active, high - active)
