"""``neuron-buckets plot TRACE -o FILE.png``: the need histogram with bucket edges and the
padding they cause (matplotlib, imported only here)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..report import report_1d
from ..trace import read_lengths
from .arguments import cost_model, grid, length_needs
from .options import cost_option, grid_options, trace_options


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Register ``plot`` and its flags."""
    parser = verbs.add_parser(
        "plot",
        help="plot the need distribution with bucket edges (PNG)",
        description="Write a PNG: the need histogram with bucket edges "
        "and padding, and real vs padded tokens per "
        "bucket. Needs matplotlib (the 'plot' extra).",
    )
    trace_options(parser, pairs=False)
    parser.add_argument("--output", "-o", type=Path, required=True, metavar="FILE.png")
    grid_options(parser)
    cost_option(parser)
    parser.set_defaults(run=run, pair=None)  # plot draws 1-D grids only


def run(args: argparse.Namespace) -> int:
    """Write the PNG; exit code 0."""
    from ..plot import plot_grid

    workload = read_lengths(args.trace)
    hist = length_needs(args, workload, args.phase)
    lengths = grid(args, args.phase)
    report = report_1d(lengths, hist, cost=cost_model(args.cost))
    written = plot_grid(
        args.output,
        hist,
        lengths,
        report,
        title=f"{args.trace.name}: {workload.requests:,} requests, "
        f"{args.phase} needs, grid {lengths}",
    )
    print(f"wrote {written}")
    return 0
