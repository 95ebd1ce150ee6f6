"""How long `neuron-buckets tune` takes to choose a grid: tune_1d over N prompt lengths
(seeded, uniform in 1..maximum) for K buckets, the median of several runs per size.

    python scripts/bench_tune.py --out bench-results/tune

A figure for docs/benchmarks.md, not a test: the time depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

from bucketing.tune import tune_1d  # noqa: E402


def time_tune(lengths: np.ndarray, buckets: int, maximum: int, repeats: int) -> float:
    """Median seconds of one tune_1d over `lengths`."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        tune_1d(lengths, buckets, maximum=maximum)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--buckets", type=int, nargs="+", default=[4, 6, 8])
    parser.add_argument("--maximum", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "tune")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for size in args.sizes:
        lengths = rng.integers(1, args.maximum + 1, size=size)
        for k in args.buckets:
            median = time_tune(lengths, k, args.maximum, args.repeats)
            rows.append({"lengths": size, "buckets": k, "median_s": median})
    table = [[f"{r['lengths']:,}", str(r["buckets"]), f"{r['median_s']:.3f}"] for r in rows]
    write_results(
        args.out,
        run_meta("bench_tune.py", argv, repeats=args.repeats),
        {"rows": rows},
        ["lengths", "K", "median seconds"],
        table,
    )


if __name__ == "__main__":
    main()
