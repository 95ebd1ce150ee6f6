"""What a grid costs on a workload: padding, expected cost, and each bucket's share.

Counted per need: a request for context encoding, a decode step for token generation.
``padded_tokens`` is positions computed for nothing: bucket - need for 1-D grids,
batch*length products for (batch, length) grids, (active + prefix) positions for prefix
grids. ``padding_ratio`` is padded / all computed positions. Needs no bucket holds are
``rejected`` and left out of every other figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .cost import DEFAULT_COST, CostModel, LinearQuadraticCost
from .fit import assign, assign_nd
from .grids import nxdi_buckets, validate_grid
from .workload import Histogram

NXDI_MIN_LENGTH = 128  # the lower bound NxDI passes to generate_buckets by default


@dataclass(frozen=True)
class BucketUse:
    """One bucket's part of the workload."""

    bucket: tuple[int, ...]
    served: int
    share: float
    tokens: int
    padded_tokens: int
    cost: float


@dataclass(frozen=True)
class Report:
    """The waste report of one grid on one workload."""

    grid: list
    rule: str
    cost_model: str
    cost_unit: str
    served: int
    rejected: int
    tokens: int
    padded_tokens: int
    expected_cost: float
    buckets: list[BucketUse] = field(default_factory=list)

    @property
    def padding_ratio(self) -> float:
        computed = self.tokens + self.padded_tokens
        return self.padded_tokens / computed if computed else 0.0

    @property
    def padded_per_need(self) -> float:
        return self.padded_tokens / self.served if self.served else 0.0

    def to_dict(self) -> dict:
        """The stable JSON form (documented in docs/reference/neuron-buckets.md)."""
        return {
            "grid": [list(b) if isinstance(b, tuple) else b for b in self.grid],
            "rule": self.rule,
            "cost_model": self.cost_model,
            "cost_unit": self.cost_unit,
            "served": self.served,
            "rejected": self.rejected,
            "tokens": self.tokens,
            "padded_tokens": self.padded_tokens,
            "padded_tokens_per_need": round(self.padded_per_need, 4),
            "padding_ratio": round(self.padding_ratio, 6),
            "expected_cost": round(self.expected_cost, 6),
            "buckets": [
                {
                    "bucket": b.bucket[0] if len(b.bucket) == 1 else list(b.bucket),
                    "served": b.served,
                    "share": round(b.share, 6),
                    "tokens": b.tokens,
                    "padded_tokens": b.padded_tokens,
                    "cost": round(b.cost, 6),
                }
                for b in self.buckets
            ],
        }


def nxdi_default_grid(maximum: int) -> list[int]:
    """The grid NxDI builds by default for ``maximum`` (generate_buckets(128, maximum))."""
    return nxdi_buckets(min(NXDI_MIN_LENGTH, maximum), maximum)


def report_1d(
    grid: Sequence[int], hist: Histogram, *, cost: CostModel | None = None, rule: str = "first_fit"
) -> Report:
    """Waste report of a 1-D grid under ``rule`` ("first_fit" or NxDI's "strict")."""
    grid = validate_grid(list(grid), name="grid")
    cost = cost or DEFAULT_COST
    index = assign(grid, hist.values, rule)
    sizes = np.asarray(grid, dtype=np.int64)
    return _summarise(
        [(b,) for b in grid],
        sizes[:, None],
        index,
        hist.values,
        hist.counts,
        cost.costs(sizes[:, None]),
        cost,
        rule,
    )


def report_2d(
    grid: Sequence[tuple[int, int]],
    needs: np.ndarray,
    counts: np.ndarray,
    *,
    pair: str = "batch",
    cost: CostModel | None = None,
) -> Report:
    """Waste report of a 2-D grid under least-cost fit (``fit.fit_nd``)."""
    if cost is None:
        cost = LinearQuadraticCost(layout="active_prefix") if pair == "prefix" else DEFAULT_COST
    shapes = np.asarray(grid, dtype=np.int64)
    index = assign_nd(grid, needs, cost=cost)
    positions = (lambda s: s.sum(axis=1)) if pair == "prefix" else (lambda s: s.prod(axis=1))
    return _summarise(
        [tuple(int(v) for v in b) for b in grid],
        shapes,
        index,
        np.asarray(needs, dtype=np.int64),
        np.asarray(counts, dtype=np.int64),
        cost.costs(shapes),
        cost,
        "least_cost_fit",
        positions,
    )


def _summarise(
    grid, shapes, index, needs, counts, prices, cost, rule, positions=lambda s: s.prod(axis=1)
) -> Report:
    served_mask = index >= 0
    idx, cnt = index[served_mask], counts[served_mask]
    need_rows = needs[served_mask].reshape(len(idx), -1)
    tokens_each = positions(need_rows) * cnt
    padded_each = (positions(shapes)[idx] * cnt) - tokens_each
    size = len(grid)
    served = np.bincount(idx, weights=cnt, minlength=size).astype(np.int64)
    tokens = np.bincount(idx, weights=tokens_each, minlength=size).astype(np.int64)
    padded = np.bincount(idx, weights=padded_each, minlength=size).astype(np.int64)
    total = int(served.sum())
    uses = [
        BucketUse(
            grid[i],
            int(served[i]),
            served[i] / total if total else 0.0,
            int(tokens[i]),
            int(padded[i]),
            float(prices[i]),
        )
        for i in range(size)
    ]
    return Report(
        grid=[g[0] if len(g) == 1 else g for g in grid],
        rule=rule,
        cost_model=cost.describe(),
        cost_unit=cost.unit,
        served=total,
        rejected=int(counts[~served_mask].sum()),
        tokens=int(tokens.sum()),
        padded_tokens=int(padded.sum()),
        expected_cost=float(np.dot(served, prices) / total) if total else 0.0,
        buckets=uses,
    )


def compare(candidate: Report, baseline: Report) -> dict:
    """How much ``candidate`` saves against ``baseline`` on the same workload."""

    def saved(new: float, old: float) -> float | None:
        return round(100.0 * (1.0 - new / old), 2) if old else None

    def ratio(new: float, old: float) -> float | None:
        return round(new / old, 4) if old else None

    return {
        "padded_tokens": candidate.padded_tokens,
        "baseline_padded_tokens": baseline.padded_tokens,
        "padded_tokens_ratio": ratio(candidate.padded_tokens, baseline.padded_tokens),
        "padded_tokens_saved_pct": saved(candidate.padded_tokens, baseline.padded_tokens),
        "expected_cost": round(candidate.expected_cost, 6),
        "baseline_expected_cost": round(baseline.expected_cost, 6),
        "expected_cost_saved_pct": saved(candidate.expected_cost, baseline.expected_cost),
    }


def against_nxdi(
    grid: Sequence[int], hist: Histogram, *, cost: CostModel | None = None, rule: str = "first_fit"
) -> tuple[Report, Report, dict]:
    """Reports of ``grid`` and of NxDI's default grid for the same maximum (same rule, same
    cost model), and the comparison of the two: the question every tuned grid must answer."""
    report = report_1d(grid, hist, cost=cost, rule=rule)
    baseline = report_1d(nxdi_default_grid(max(grid)), hist, cost=cost, rule=rule)
    return report, baseline, compare(report, baseline)
