"""Flags several verbs share, added to their subparsers in one place so every verb spells
and documents them the same way."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..workload import PHASES

# The override_neuron_config list each phase's 1-D grid is written to.
PHASE_KEYS = {"context": "context_encoding_buckets", "decode": "token_generation_buckets"}


def grid_options(parser: argparse.ArgumentParser) -> None:
    """--buckets | --bucket-file [--key] | --max with a generator."""
    group = parser.add_argument_group("grid (one of --buckets, --bucket-file, --max)")
    group.add_argument("--buckets", metavar="LIST", help="explicit grid, e.g. 128,512,2048")
    group.add_argument(
        "--bucket-file", type=Path, metavar="FILE", help="bucket-set file (.yaml/.json); see --key"
    )
    group.add_argument(
        "--key",
        choices=tuple(PHASE_KEYS.values()),
        help="list to use from --bucket-file (default: the phase's list)",
    )
    group.add_argument(
        "--generator",
        choices=("nxdi", "geometric", "linear", "chunk"),
        default="nxdi",
        help="generator used with --max (default nxdi: NxDI's powers of two)",
    )
    group.add_argument(
        "--min",
        type=int,
        default=128,
        metavar="N",
        help="smallest length for the generator (default 128)",
    )
    group.add_argument(
        "--max", type=int, metavar="N", help="largest bucket (max_model_len) for the generator"
    )
    group.add_argument("--ratio", type=float, metavar="R", help="geometric: ratio (default 2)")
    group.add_argument("--step", type=int, metavar="N", help="linear: step")
    group.add_argument("--tile", type=int, metavar="N", help="chunk: attention q-tile size")
    group.add_argument(
        "--align",
        type=int,
        metavar="A",
        help="round generated buckets up to multiples of A; check explicit ones",
    )


def second_dimension_options(parser: argparse.ArgumentParser) -> None:
    """--batches / --prefix-buckets: the second dimension of 2-D grids."""
    group = parser.add_argument_group("second dimension (2-D grids)")
    group.add_argument(
        "--batches",
        metavar="LIST",
        help="token-generation batch buckets, e.g. 1,2,4: (batch, length) grid",
    )
    group.add_argument(
        "--prefix-buckets",
        metavar="LIST",
        help="prefix buckets, e.g. 512,1024: (active, prefix) grid, 0 added",
    )


def trace_options(
    parser: argparse.ArgumentParser, *, pairs: bool = True, phases: tuple[str, ...] = PHASES
) -> None:
    """TRACE and how to turn it into needs (phase, prefix caching, speculation, pair)."""
    parser.add_argument(
        "trace",
        type=Path,
        metavar="TRACE",
        help="JSONL (prompt_tokens[, output_tokens, batch, "
        "prefix_hit_tokens]), CSV (ContextTokens, GeneratedTokens), "
        "one length per line, or a {histogram: {length: count}} file",
    )
    both = " or both (context and decode, into one bucket set)" if "both" in phases else ""
    parser.add_argument(
        "--phase",
        choices=phases,
        default="context",
        help="context: prompt tokens to compute; decode: full_context_len of "
        f"every decode step (needs output_tokens){both}",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="context needs are prompt minus prefix_hit_tokens",
    )
    parser.add_argument(
        "--speculation",
        type=int,
        default=0,
        metavar="S",
        help="speculation length added to decode needs (default 0)",
    )
    if pairs:
        parser.add_argument(
            "--pair",
            choices=("batch", "prefix"),
            help="2-D: (batch, length) or (active, prefix) needs",
        )


def cost_option(parser: argparse.ArgumentParser) -> None:
    """--cost latency|tokens|FILE."""
    parser.add_argument(
        "--cost",
        default="latency",
        metavar="MODEL",
        help="latency (default linear+quadratic model, ms), tokens (padded "
        "tokens), or a measured cost table FILE (.yaml/.json)",
    )


def json_option(parser: argparse.ArgumentParser) -> None:
    """--json: the stable machine-readable form."""
    parser.add_argument("--json", action="store_true", help="print the stable JSON form")
