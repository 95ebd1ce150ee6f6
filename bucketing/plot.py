"""A picture of a grid on a workload: the length histogram with bucket edges, and each
bucket's real versus padded tokens. matplotlib is an optional extra, imported here only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import BucketError
from .report import Report
from .workload import Histogram

BINS = 160


def plot_grid(
    path: str | Path, hist: Histogram, grid: Sequence[int], report: Report, *, title: str = ""
) -> Path:
    """Write a PNG: top, the need histogram with one line per bucket edge and each
    bucket's padding shaded; bottom, real and padded tokens per bucket."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BucketError(
            "plotting needs matplotlib; install the extra: pip install 'vllm-neuron-plugin[plot]'"
        ) from None
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise BucketError(f"plot output {path} must end in .png")
    # Show a margin past the largest bucket, not the whole tail of rejected needs.
    top = int(grid[-1] * 1.08) if hist.values.max() > grid[-1] else int(grid[-1])
    figure, (upper, lower) = plt.subplots(
        2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]}
    )
    upper.hist(
        hist.values,
        bins=np.linspace(0, top, BINS + 1),
        weights=hist.counts,
        color="#4c72b0",
        label="needs (requests or decode steps)",
    )
    lower_edge = 0
    for index, bucket in enumerate(grid):
        # Everything served by this bucket pads up to its edge: shade that span.
        upper.axvspan(
            lower_edge, bucket, color="#dd8452" if index % 2 else "#f0c08a", alpha=0.18, lw=0
        )
        upper.axvline(bucket, color="#c44e52", lw=1.2)
        upper.annotate(
            str(bucket),
            (bucket, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#c44e52",
        )
        lower_edge = bucket
    if hist.values.max() > grid[-1]:
        upper.axvspan(
            grid[-1],
            top,
            color="grey",
            alpha=0.3,
            lw=0,
            label=f"rejected: {report.rejected} (above {grid[-1]})",
        )
    upper.set_xlim(0, top)
    upper.set_xlabel("need (tokens)")
    upper.set_ylabel("count")
    upper.legend(loc="center right", fontsize=8)
    upper.set_title(title or f"grid {list(grid)}")
    labels = [str(use.bucket[0]) for use in report.buckets]
    real = [use.tokens for use in report.buckets]
    padded = [use.padded_tokens for use in report.buckets]
    lower.bar(labels, real, color="#4c72b0", label="real tokens")
    lower.bar(labels, padded, bottom=real, color="#dd8452", label="padded tokens")
    lower.set_xlabel("bucket")
    lower.set_ylabel("tokens")
    lower.legend(loc="upper left", fontsize=8)
    lower.set_title(
        f"padded {report.padded_tokens:,} of {report.tokens + report.padded_tokens:,} "
        f"computed tokens ({100 * report.padding_ratio:.1f}%), expected cost "
        f"{report.expected_cost:.2f} {report.cost_unit}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
