"""Whether sampled tokens follow a distribution: Pearson's chi-square tests at a fixed
significance (0.001), for draws against known probabilities and for two sets of draws
against each other. Cells expected fewer than 5 times are pooled, as the test requires;
the chi-square quantile is Wilson and Hilferty's approximation (exact to ~1% at the
degrees of freedom used here), so no statistics library is needed on a serving host."""

from __future__ import annotations

import math

import numpy as np

SIGNIFICANCE = 0.001
SIGNIFICANCE_Z = 3.090  # the standard normal quantile at 1 - SIGNIFICANCE
MIN_EXPECTED = 5.0


def chi_square_limit(df: int) -> float:
    """The chi-square quantile at 1 - SIGNIFICANCE for `df` degrees of freedom."""
    return df * (1 - 2 / (9 * df) + SIGNIFICANCE_Z * math.sqrt(2 / (9 * df))) ** 3


def _pooled(expected: np.ndarray, *observed: np.ndarray) -> tuple[np.ndarray, ...]:
    """Cells expected at least MIN_EXPECTED times alone, the rest in one pooled cell
    (folded into the smallest kept cell when even the pool is thin)."""
    alone = expected >= MIN_EXPECTED
    columns = [np.append(a[alone], a[~alone].sum()) for a in (expected, *observed)]
    if columns[0][-1] < MIN_EXPECTED and len(columns[0]) > 1:
        columns = [np.append(c[:-2], c[-2:].sum()) for c in columns]
    return tuple(columns)


def goodness_of_fit(counts: np.ndarray, probabilities: np.ndarray) -> tuple[bool, str]:
    """Do draws (`counts` per token) fit `probabilities`? Any draw where the probability
    is 0 fails outright."""
    outside = int(counts[probabilities == 0].sum())
    if outside:
        return False, f"{outside} draws where the probability is 0"
    want, got = _pooled(counts.sum() * probabilities, counts.astype(float))
    stat = float(((got - want) ** 2 / want).sum())
    df = max(1, len(want) - 1)
    limit = chi_square_limit(df)
    return stat <= limit, f"chi-square {stat:.1f} on {df} df, limit {limit:.1f}"


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[bool, str]:
    """Do two sets of draws (counts per token) come from one distribution? The 2 x k
    contingency test, cells pooled by their expected count in the smaller sample."""
    total_a, total_b = a.sum(), b.sum()
    pooled = (a + b) / (total_a + total_b)
    want, got_a, got_b = _pooled(min(total_a, total_b) * pooled, a.astype(float), b.astype(float))
    share = (got_a + got_b) / (total_a + total_b)
    stat = 0.0
    for got, total in ((got_a, total_a), (got_b, total_b)):
        expected = share * total
        stat += float(((got - expected) ** 2 / expected).sum())
    df = max(1, len(want) - 1)
    limit = chi_square_limit(df)
    return stat <= limit, (
        f"chi-square {stat:.1f} on {df} df, limit {limit:.1f} "
        f"({int(total_a)} and {int(total_b)} draws)"
    )
