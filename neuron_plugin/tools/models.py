"""`neuron-plugin models`: the architecture table as this environment serves it, the
classes registered under the entry-point group included (models.third_party), in the
docs' Markdown (docs/serving/architectures.md prints the built-in rows)."""

from __future__ import annotations

import argparse

from neuron_plugin.models.render import markdown
from neuron_plugin.models.table import ROWS
from neuron_plugin.models.third_party import ENTRY_POINT_GROUP, entry_points, with_registered


def add_parser(verbs: argparse._SubParsersAction) -> None:
    parser = verbs.add_parser(
        "models",
        help="print the architecture table (with classes registered in this environment)",
        description=(
            f"Which class serves each architecture, per backend and NxDI release; classes "
            f"registered under the {ENTRY_POINT_GROUP!r} entry-point group included."
        ),
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(markdown(with_registered(ROWS, entry_points())), end="")
    return 0
