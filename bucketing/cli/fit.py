"""``neuron-buckets fit N``: which bucket one need takes, under this project's ``>=`` rule
and NxDI's strict ``<`` rule, and why."""

from __future__ import annotations

import argparse

from ..errors import NoFitError
from ..fit import decode_need, first_fit, fit_nd, prefix_caching_fit, strict_fit
from ..grids import batch_grid, prefix_grid
from ..workload import PHASES
from .arguments import cost_model, grid, second_dimension
from .options import cost_option, grid_options, json_option, second_dimension_options
from .output import print_json


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Register ``fit`` and its flags."""
    parser = verbs.add_parser(
        "fit",
        help="fit one need to a grid and say why",
        description="Fit one need to a grid under this project's rule "
        "(smallest bucket >= need) and under NxDI's strict "
        "rule (first bucket > need), and explain both.",
    )
    parser.add_argument(
        "need",
        type=int,
        metavar="N",
        help="context phase: tokens to compute; decode phase: the position "
        "of the token being decoded (needs N + 1 + speculation)",
    )
    parser.add_argument(
        "--phase",
        choices=PHASES,
        default="context",
        help="context (default) or decode: what N means",
    )
    parser.add_argument(
        "--speculation",
        type=int,
        default=0,
        metavar="S",
        help="speculation length added to decode needs (default 0)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        metavar="B",
        help="batch size to fit too, against --batches / token_generation_batches",
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        metavar="P",
        help="prefix-cache hit to fit too, against --prefix-buckets",
    )
    grid_options(parser)
    second_dimension_options(parser)
    cost_option(parser)
    json_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the fit and its reasons; exit code 1 when nothing fits."""
    lengths = grid(args, args.phase)
    if args.phase == "decode":
        need = decode_need(args.need, args.speculation)
        why_need = (
            f"decoding position {args.need} attends {need} positions (position + 1"
            f"{f' + speculation {args.speculation}' if args.speculation else ''})"
        )
    else:
        need = args.need
        why_need = f"context encoding computes {need} tokens"
    result: dict = {"need": need, "phase": args.phase, "grid": lengths}
    try:
        text = (
            _fit_2d(args, lengths, need, result)
            if _second(args)
            else _fit_1d(lengths, need, result)
        )
    except NoFitError as exc:
        result.update(bucket=None, error=str(exc))
        text = [f"no fit: {exc}"]
        code = 1
    else:
        code = 0
    if args.json:
        print_json("fit", result)
    else:
        print("\n".join([why_need, *text]))
    return code


def _second(args: argparse.Namespace) -> bool:
    return args.batch is not None or args.prefix_len is not None


def _fit_1d(lengths: list[int], need: int, result: dict) -> list[str]:
    bucket = first_fit(lengths, need)
    below = [b for b in lengths if b < need]
    reason = f"smallest bucket >= {need}" + (f" ({below[-1]} < {need})" if below else "")
    strict = strict_fit(lengths, need)
    result.update(
        bucket=bucket,
        padding=bucket - need,
        reason=reason,
        strict_bucket=strict,
        strict_padding=strict - need,
    )
    note = (
        " - same"
        if strict == bucket
        else f" - NxDI takes the first bucket > {need}, skipping {bucket}, and pads "
        f"{strict - bucket} more tokens"
    )
    return [
        f"grid: {lengths}",
        f"first fit: {bucket} - {reason}; pads {bucket - need} tokens "
        f"({100 * (bucket - need) / bucket:.1f}% of the bucket)",
        f"NxDI strict (<): {strict}{note}",
    ]


def _fit_2d(args: argparse.Namespace, lengths: list[int], need: int, result: dict) -> list[str]:
    if args.batch is not None:
        batches = second_dimension(args, "--batches", "token_generation_batches", "--batch")
        pair, shapes, full = "batch", batch_grid(batches, lengths), (args.batch, need)
    else:
        prefixes = second_dimension(args, "--prefix-buckets", "prefix_buckets", "--prefix-len")
        pair, shapes, full = "prefix", prefix_grid(lengths, prefixes), (need, args.prefix_len)
    cost = cost_model(args.cost, pair)
    bucket = fit_nd(shapes, full, cost=cost)
    fitting = [s for s in shapes if all(b >= n for b, n in zip(s, full, strict=True))]
    result.update(
        need=list(full),
        bucket=list(bucket),
        shapes=len(shapes),
        fitting=len(fitting),
        cost=round(cost(bucket), 6),
        reason=f"least-cost of the {len(fitting)} shapes >= {full} in every "
        f"dimension ({cost.describe()})",
    )
    text = [
        f"{pair} grid: {len(shapes)} shapes; need {full}",
        f"fit: {bucket} - {result['reason']}; cost {cost(bucket):.2f} {cost.unit}",
    ]
    if pair == "prefix":
        # What NxDI's prefix-caching context encoding (and so the plugin) runs.
        nxdi = prefix_caching_fit(lengths, sorted({p for _, p in shapes}), need, args.prefix_len)
        result["nxdi_bucket"] = list(nxdi)
        text.append(
            f"NxDI prefix caching: {nxdi} - the active bucket's spare slots "
            f"re-encode the prefix's tail; cost {cost(nxdi):.2f} {cost.unit}"
        )
    return text
