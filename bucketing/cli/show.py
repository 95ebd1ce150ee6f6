"""``neuron-buckets show``: the grid a generator builds, and its 2-D cross product."""

from __future__ import annotations

import argparse

from ..grids import batch_grid, prefix_grid
from .arguments import grid, second_dimension
from .options import grid_options, json_option, second_dimension_options
from .output import print_json


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Register ``show`` and its flags."""
    parser = verbs.add_parser(
        "show",
        help="print a grid for given limits and generator",
        description="Print the grid a generator builds (and its 2-D "
        "cross products with --batches or "
        "--prefix-buckets).",
    )
    grid_options(parser)
    second_dimension_options(parser)
    json_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the grid; exit code 0."""
    lengths = grid(args)
    batches = second_dimension(args, "--batches", "token_generation_batches")
    prefixes = second_dimension(args, "--prefix-buckets", "prefix_buckets")
    shapes = (
        batch_grid(batches, lengths)
        if batches
        else prefix_grid(lengths, prefixes)
        if prefixes
        else None
    )
    graphs = len(shapes) if shapes else len(lengths)
    if args.json:
        print_json(
            "show",
            {
                "grid": lengths,
                "graphs": graphs,
                "shapes": [list(s) for s in shapes] if shapes else None,
            },
        )
        return 0
    print(f"{len(lengths)} buckets: {lengths}")
    if shapes:
        kind = "(batch, length)" if batches else "(active, prefix)"
        print(f"{graphs} {kind} graphs: {', '.join(str(s) for s in shapes)}")
    return 0
