"""``neuron-buckets replay TRACE``: the waste report of a grid on real traffic, next to
NxDI's default grid for the same maximum."""

from __future__ import annotations

import argparse

from ..grids import batch_grid, prefix_grid
from ..trace import read_lengths
from .arguments import against_default, cost_model, grid, phase_needs, second_dimension
from .options import cost_option, grid_options, json_option, second_dimension_options, trace_options
from .output import print_json, print_report, workload_summary


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Register ``replay`` and its flags."""
    parser = verbs.add_parser(
        "replay",
        help="replay a trace against a grid: waste report",
        description="Replay a trace (JSONL, CSV, plain list or "
        "histogram) against a grid and report padded "
        "tokens, padding ratio, expected cost and each "
        "bucket's share, next to NxDI's default grid.",
    )
    trace_options(parser)
    parser.add_argument(
        "--rule",
        choices=("first_fit", "strict"),
        default="first_fit",
        help="fit rule for 1-D grids: this project's >= or NxDI's strict <",
    )
    grid_options(parser)
    second_dimension_options(parser)
    cost_option(parser)
    json_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit code 0."""
    workload = read_lengths(args.trace)
    data = phase_needs(args, workload, args.phase, args.pair)
    lengths = grid(args, args.phase)
    shapes = _shapes(args, lengths) if args.pair else lengths
    report, baseline, comparison = against_default(
        shapes, data, cost_model(args.cost, args.pair), args.pair, rule=args.rule
    )
    if args.json:
        print_json(
            "replay",
            {
                "workload": workload_summary(
                    args, workload, args.phase, report.served + report.rejected
                ),
                "report": report.to_dict(),
                "baseline": {"name": "nxdi_default", **baseline.to_dict()},
                "comparison": comparison,
            },
        )
        return 0
    print(
        f"{args.trace}: {workload.requests:,} requests, {args.phase} phase; grid "
        f"{report.grid} ({report.rule}); cost: {report.cost_model}"
    )
    print_report(report, baseline, comparison)
    return 0


def _shapes(args: argparse.Namespace, lengths: list[int]) -> list[tuple[int, int]]:
    """The 2-D grid of --pair: the length grid crossed with the required second list."""
    if args.pair == "batch":
        batches = second_dimension(args, "--batches", "token_generation_batches", "--pair batch")
        return batch_grid(batches, lengths)
    prefixes = second_dimension(args, "--prefix-buckets", "prefix_buckets", "--pair prefix")
    return prefix_grid(lengths, prefixes)
