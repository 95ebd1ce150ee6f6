"""Parsed flags -> the objects the library works on: grids, cost models, needs, and a
report next to NxDI's default grid for the same limits."""

from __future__ import annotations

import argparse
from typing import overload

import numpy as np

from ..cost import DEFAULT_COST, CostModel, LinearQuadraticCost, PaddedTokenCost, load_cost_table
from ..errors import BucketError
from ..files import load_bucket_set
from ..grids import batch_grid, explicit, make_grid, nxdi_buckets, prefix_grid, validate_grid
from ..report import Report, against_nxdi, compare, nxdi_default_grid, report_2d
from ..workload import Histogram, Workload, needs, paired_needs
from .options import PHASE_KEYS

NXDI_PREFIX_MIN = 512  # NxDI's default lower bound for prefix-caching context grids

# 1-D needs (a Histogram: distinct needs, counts), or 2-D needs as (distinct rows, counts).
Needs = tuple[np.ndarray, np.ndarray]


def int_list(flag: str, text: str) -> list[int]:
    """A comma-separated flag value as whole numbers."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BucketError(
            f"{flag} {text!r} is not a comma-separated list of whole numbers; "
            f"write e.g. 128,512,2048"
        ) from None


def cost_model(spec: str, pair: str | None = None) -> CostModel:
    """--cost: the latency model (prefix layout for prefix pairs), tokens, or a table."""
    if spec == "latency":
        return LinearQuadraticCost(layout="active_prefix") if pair == "prefix" else DEFAULT_COST
    if spec == "tokens":
        return PaddedTokenCost()
    return load_cost_table(spec)


def grid(args: argparse.Namespace, phase: str = "context") -> list[int]:
    """The length grid from --buckets, --bucket-file or --max with a generator."""
    if args.buckets:
        return list(
            validate_grid(
                explicit(int_list("--buckets", args.buckets)), name="--buckets", align=args.align
            )
        )
    if args.bucket_file:
        key = args.key or PHASE_KEYS[phase]
        lists = load_bucket_set(args.bucket_file)
        if key not in lists:
            raise BucketError(
                f"{args.bucket_file} has no {key} (it has {', '.join(lists)}); pass --key"
            )
        return lists[key]
    if args.max is None:
        raise BucketError(
            "no grid given; pass --buckets LIST, --bucket-file FILE, or --max N (with --generator)"
        )
    return make_grid(
        args.generator,
        min_length=args.min,
        max_length=args.max,
        ratio=args.ratio,
        step=args.step,
        tile=args.tile,
        align=args.align,
    )


@overload
def second_dimension(args: argparse.Namespace, flag: str, key: str, why: str) -> list[int]: ...
@overload
def second_dimension(
    args: argparse.Namespace, flag: str, key: str, why: None = None
) -> list[int] | None: ...
def second_dimension(
    args: argparse.Namespace, flag: str, key: str, why: str | None = None
) -> list[int] | None:
    """The second dimension's list from its flag, else from --bucket-file when it has it;
    when ``why`` is given the list is required and its absence is an error."""
    text = getattr(args, flag.lstrip("-").replace("-", "_"))
    found = (
        explicit(int_list(flag, text))
        if text
        else load_bucket_set(args.bucket_file).get(key)
        if args.bucket_file
        else None
    )
    if found is None and why is not None:
        raise BucketError(
            f"{why} needs the second dimension: pass {flag} (or a --bucket-file with {key})"
        )
    return found


def phase_needs(
    args: argparse.Namespace, workload: Workload, phase: str, pair: str | None
) -> Needs:
    """What ``phase`` needs from a grid on this workload; an empty result is an error
    because no grid can be judged or tuned on nothing."""
    if pair:
        rows, counts = paired_needs(workload, pair, phase, speculation_length=args.speculation)
        if not counts.size:
            raise BucketError(f"{args.trace} has no {phase} needs; no request decodes")
        return rows, counts
    return length_needs(args, workload, phase)


def length_needs(args: argparse.Namespace, workload: Workload, phase: str) -> Histogram:
    """The 1-D needs of ``phase`` (see phase_needs)."""
    hist = needs(
        workload, phase, prefix_caching=args.prefix_caching, speculation_length=args.speculation
    )
    if not hist.counts.size:
        raise BucketError(
            f"{args.trace} has no {phase} needs (every output_tokens < 2); use --phase context"
        )
    return hist


def against_default(
    grid_or_shapes: list, data: Needs, cost: CostModel, pair: str | None, rule: str = "first_fit"
) -> tuple[Report, Report, dict]:
    """(report, NxDI default grid's report, comparison) for the same limits: a 1-D grid
    against generate_buckets(128, max); a 2-D grid against NxDI's 2-D default."""
    if not pair:
        return against_nxdi(grid_or_shapes, Histogram(*data), cost=cost, rule=rule)
    report = report_2d(grid_or_shapes, *data, pair=pair, cost=cost)
    baseline = report_2d(_baseline_2d(pair, grid_or_shapes), *data, pair=pair, cost=cost)
    return report, baseline, compare(report, baseline)


def _baseline_2d(pair: str, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """NxDI's default grid for the limits of ``shapes``: one batch size (no batch
    bucketing), or its prefix-caching context grid (512 .. max in both dimensions,
    prefix 0 added)."""
    if pair == "batch":
        return batch_grid([max(b for b, _ in shapes)], nxdi_default_grid(max(n for _, n in shapes)))
    maximum = max(active for active, _ in shapes)
    low = min(NXDI_PREFIX_MIN, maximum)
    return prefix_grid(nxdi_buckets(low, maximum), nxdi_buckets(low, maximum))
