"""``neuron-buckets``: show, fit, replay, tune and plot bucket grids.

Every verb has ``--help``; ``--json`` output is stable (schema names end in /v1) and
documented in bucketing/README.md. Exit codes: 0 ok, 1 the need fits no bucket (fit),
2 bad input (the message names the flag, file or key and the fix).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from .cost import DEFAULT_COST, CostModel, LinearQuadraticCost, PaddedTokenCost, load_cost_table
from .errors import BucketError, NoFitError
from .files import dump_bucket_set, load_bucket_set
from .fit import decode_need, first_fit, fit_nd, strict_fit
from .grids import batch_grid, explicit, make_grid, nxdi_buckets, prefix_grid, validate_grid
from .report import (Report, against_nxdi, compare, nxdi_default_grid, report_1d,
                     report_2d)
from .trace import read_lengths
from .tune import buckets_within_budget, tune_1d, tune_2d
from .workload import PHASES, needs, paired_needs

SCHEMA = "neuron-buckets/{}/v1"
PHASE_KEYS = {"context": "context_encoding_buckets", "decode": "token_generation_buckets"}
NXDI_PREFIX_MIN = 512  # NxDI's default lower bound for prefix-caching context grids


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BucketError as exc:
        print(f"neuron-buckets {args.verb}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-buckets",
        description="Bucket grids for Neuron graphs: show a grid, fit a need to it, replay a "
                    "trace against it, tune one from a trace, plot it.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    show = verbs.add_parser("show", help="print a grid for given limits and generator",
                            description="Print the grid a generator builds (and its 2-D "
                                        "cross products with --batches or --prefix-buckets).")
    _grid_options(show)
    _second_dimension_options(show)
    _json_option(show)
    show.set_defaults(run=_show)

    fit = verbs.add_parser("fit", help="fit one need to a grid and say why",
                           description="Fit one need to a grid under this project's rule "
                                       "(smallest bucket >= need) and under NxDI's strict "
                                       "rule (first bucket > need), and explain both.")
    fit.add_argument("need", type=int, metavar="N",
                     help="context phase: tokens to compute; decode phase: the position of "
                          "the token being decoded (needs N + 1 + speculation)")
    fit.add_argument("--phase", choices=PHASES, default="context",
                     help="context (default) or decode: what N means")
    fit.add_argument("--speculation", type=int, default=0, metavar="S",
                     help="speculation length added to decode needs (default 0)")
    fit.add_argument("--batch", type=int, metavar="B",
                     help="batch size to fit too, against --batches / token_generation_batches")
    fit.add_argument("--prefix-len", type=int, metavar="P",
                     help="prefix-cache hit to fit too, against --prefix-buckets")
    _grid_options(fit)
    _second_dimension_options(fit)
    _cost_option(fit, "latency")
    _json_option(fit)
    fit.set_defaults(run=_fit)

    replay = verbs.add_parser("replay", help="replay a trace against a grid: waste report",
                              description="Replay a trace (JSONL, CSV, plain list or "
                                          "histogram) against a grid and report padded "
                                          "tokens, padding ratio, expected cost and each "
                                          "bucket's share, next to NxDI's default grid.")
    _trace_options(replay)
    replay.add_argument("--rule", choices=("first_fit", "strict"), default="first_fit",
                        help="fit rule for 1-D grids: this project's >= or NxDI's strict <")
    _grid_options(replay)
    _second_dimension_options(replay)
    _cost_option(replay, "latency")
    _json_option(replay)
    replay.set_defaults(run=_replay)

    tune = verbs.add_parser("tune", help="tune a grid to a trace or histogram",
                            description="Find the grid of at most K buckets (largest = --max) "
                                        "with least expected cost on the trace; exact for "
                                        "1-D, alternating exact solves for 2-D (--pair).")
    _trace_options(tune)
    tune.add_argument("--max", type=int, required=True, metavar="N",
                      help="largest bucket: max_model_len (or max context length)")
    tune.add_argument("--max-buckets", "-k", type=int, default=6, metavar="K",
                      help="at most K buckets in the length dimension (default 6)")
    tune.add_argument("--align", type=int, metavar="A",
                      help="buckets must be multiples of A (the KV block size)")
    tune.add_argument("--max-batch-buckets", type=int, default=3, metavar="K",
                      help="--pair batch: at most K batch buckets (default 3)")
    tune.add_argument("--max-num-seqs", type=int, metavar="N",
                      help="--pair batch: largest batch bucket")
    tune.add_argument("--max-prefix-buckets", type=int, default=4, metavar="K",
                      help="--pair prefix: at most K prefix buckets, prefix 0 included "
                           "(default 4)")
    tune.add_argument("--compile-budget", type=float, metavar="SECONDS",
                      help="cap the number of graphs to what this compile time pays for "
                           "(needs --seconds-per-graph)")
    tune.add_argument("--seconds-per-graph", type=float, metavar="SECONDS",
                      help="measured compile time of one graph")
    tune.add_argument("--output", "-o", type=Path, metavar="FILE",
                      help="write the tuned bucket set (.yaml, .yml or .json)")
    _cost_option(tune, "latency")
    _json_option(tune)
    tune.set_defaults(run=_tune)

    plot = verbs.add_parser("plot", help="plot the need distribution with bucket edges (PNG)",
                            description="Write a PNG: the need histogram with bucket edges "
                                        "and padding, and real vs padded tokens per bucket. "
                                        "Needs matplotlib (the 'plot' extra).")
    _trace_options(plot, pairs=False)
    plot.add_argument("--output", "-o", type=Path, required=True, metavar="FILE.png")
    _grid_options(plot)
    _cost_option(plot, "latency")
    plot.set_defaults(run=_plot, pair=None)  # plot draws 1-D grids only
    return parser


def _grid_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("grid (one of --buckets, --bucket-file, --max)")
    group.add_argument("--buckets", metavar="LIST", help="explicit grid, e.g. 128,512,2048")
    group.add_argument("--bucket-file", type=Path, metavar="FILE",
                       help="bucket-set file (.yaml/.json); see --key")
    group.add_argument("--key", choices=tuple(PHASE_KEYS.values()),
                       help="list to use from --bucket-file (default: the phase's list)")
    group.add_argument("--generator", choices=("nxdi", "geometric", "linear", "chunk"),
                       default="nxdi", help="generator used with --max (default nxdi: "
                                            "NxDI's powers of two)")
    group.add_argument("--min", type=int, default=128, metavar="N",
                       help="smallest length for the generator (default 128)")
    group.add_argument("--max", type=int, metavar="N",
                       help="largest bucket (max_model_len) for the generator")
    group.add_argument("--ratio", type=float, metavar="R", help="geometric: ratio (default 2)")
    group.add_argument("--step", type=int, metavar="N", help="linear: step")
    group.add_argument("--tile", type=int, metavar="N", help="chunk: attention q-tile size")
    group.add_argument("--align", type=int, metavar="A",
                       help="round generated buckets up to multiples of A; check explicit "
                            "ones")


def _second_dimension_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("second dimension (2-D grids)")
    group.add_argument("--batches", metavar="LIST",
                       help="token-generation batch buckets, e.g. 1,2,4: (batch, length) grid")
    group.add_argument("--prefix-buckets", metavar="LIST",
                       help="prefix buckets, e.g. 512,1024: (active, prefix) grid, 0 added")


def _trace_options(parser: argparse.ArgumentParser, pairs: bool = True) -> None:
    parser.add_argument("trace", type=Path, metavar="TRACE",
                        help="JSONL (prompt_tokens[, output_tokens, batch, "
                             "prefix_hit_tokens]), CSV (ContextTokens, GeneratedTokens), "
                             "one length per line, or a {histogram: {length: count}} file")
    parser.add_argument("--phase", choices=PHASES, default="context",
                        help="context: prompt tokens to compute; decode: full_context_len of "
                             "every decode step (needs output_tokens)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="context needs are prompt minus prefix_hit_tokens")
    parser.add_argument("--speculation", type=int, default=0, metavar="S",
                        help="speculation length added to decode needs (default 0)")
    if pairs:
        parser.add_argument("--pair", choices=("batch", "prefix"),
                            help="2-D: (batch, length) or (active, prefix) needs")


def _cost_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--cost", default=default, metavar="MODEL",
                        help="latency (default linear+quadratic model, ms), tokens (padded "
                             "tokens), or a measured cost table FILE (.yaml/.json)")


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the stable JSON form")


# ---- shared helpers -------------------------------------------------------------------

def _int_list(flag: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BucketError(f"{flag} {text!r} is not a comma-separated list of whole numbers; "
                          f"write e.g. 128,512,2048") from None


def _cost(spec: str, pair: str | None = None) -> CostModel:
    if spec == "latency":
        return LinearQuadraticCost(layout="active_prefix") if pair == "prefix" else DEFAULT_COST
    if spec == "tokens":
        return PaddedTokenCost()
    return load_cost_table(spec)


def _grid(args: argparse.Namespace, phase: str = "context") -> list[int]:
    if args.buckets:
        return list(validate_grid(explicit(_int_list("--buckets", args.buckets)),
                                  name="--buckets", align=args.align))
    if args.bucket_file:
        key = args.key or PHASE_KEYS[phase]
        lists = load_bucket_set(args.bucket_file)
        if key not in lists:
            raise BucketError(f"{args.bucket_file} has no {key} (it has "
                              f"{', '.join(lists)}); pass --key")
        return lists[key]
    if args.max is None:
        raise BucketError("no grid given; pass --buckets LIST, --bucket-file FILE, or --max N "
                          "(with --generator)")
    return make_grid(args.generator, min_length=args.min, max_length=args.max,
                     ratio=args.ratio, step=args.step, tile=args.tile, align=args.align)


def _second(args: argparse.Namespace, flag: str, key: str,
            why: str | None = None) -> list[int] | None:
    """The second dimension's list from its flag, else from --bucket-file when it has it;
    when ``why`` is given the list is required and its absence is an error."""
    text = getattr(args, flag.lstrip("-").replace("-", "_"))
    found = (explicit(_int_list(flag, text)) if text else
             load_bucket_set(args.bucket_file).get(key) if args.bucket_file else None)
    if found is None and why:
        raise BucketError(f"{why} needs the second dimension: pass {flag} (or a "
                          f"--bucket-file with {key})")
    return found


def _print_json(verb: str, body: dict) -> None:
    print(json.dumps({"schema": SCHEMA.format(verb), **body}, indent=2))


def _workload_needs(args: argparse.Namespace):
    workload = read_lengths(args.trace)
    if args.pair:
        rows, counts = paired_needs(workload, args.pair, args.phase,
                                    speculation_length=args.speculation)
        if not counts.size:
            raise BucketError(f"{args.trace} has no {args.phase} needs; no request decodes")
        return workload, (rows, counts)
    hist = needs(workload, args.phase, prefix_caching=args.prefix_caching,
                 speculation_length=args.speculation)
    if not hist.counts.size:
        raise BucketError(f"{args.trace} has no {args.phase} needs (every output_tokens < 2); "
                          f"use --phase context")
    return workload, hist


def _workload_summary(args: argparse.Namespace, workload, report: Report) -> dict:
    return {"source": str(args.trace), "requests": workload.requests, "phase": args.phase,
            "pair": args.pair, "prefix_caching": args.prefix_caching,
            "speculation": args.speculation, "needs": report.served + report.rejected}


def _table(report: Report) -> str:
    lines = [f"{'bucket':>14} {'served':>9} {'share':>7} {'tokens':>13} {'padded':>13} "
             f"{'cost/' + report.cost_unit:>10}"]
    for use in report.buckets:
        shape = use.bucket[0] if len(use.bucket) == 1 else "x".join(map(str, use.bucket))
        lines.append(f"{str(shape):>14} {use.served:>9} {100 * use.share:>6.1f}% "
                     f"{use.tokens:>13,} {use.padded_tokens:>13,} {use.cost:>10.2f}")
    lines.append(f"served {report.served:,} needs, rejected {report.rejected:,}; padded "
                 f"{report.padded_tokens:,} tokens ({100 * report.padding_ratio:.1f}% of "
                 f"computed, {report.padded_per_need:.1f} per need); expected cost "
                 f"{report.expected_cost:.2f} {report.cost_unit} per need")
    return "\n".join(lines)


def _comparison_line(comparison: dict, name: str) -> str:
    def change(pct: float | None, less: str, more: str) -> str:
        return "n/a" if pct is None else f"{abs(pct)}% {less if pct >= 0 else more}"

    return (f"vs {name}: padded tokens {comparison['padded_tokens']:,} vs "
            f"{comparison['baseline_padded_tokens']:,} "
            f"({change(comparison['padded_tokens_saved_pct'], 'fewer', 'more')}), expected "
            f"cost {change(comparison['expected_cost_saved_pct'], 'lower', 'higher')}")


def _baseline_2d(pair: str, maximum: int, batch_max: int | None) -> list[tuple[int, int]]:
    """NxDI's default grid for the same limits: one batch size (no batch bucketing), or
    its prefix-caching context grid (512 .. max in both dimensions, prefix 0 added)."""
    if pair == "batch":
        return batch_grid([batch_max], nxdi_default_grid(maximum))
    low = min(NXDI_PREFIX_MIN, maximum)
    return prefix_grid(nxdi_buckets(low, maximum), nxdi_buckets(low, maximum))


# ---- verbs ----------------------------------------------------------------------------

def _show(args: argparse.Namespace) -> int:
    grid = _grid(args)
    batches = _second(args, "--batches", "token_generation_batches")
    prefixes = _second(args, "--prefix-buckets", "prefix_buckets")
    shapes = (batch_grid(batches, grid) if batches
              else prefix_grid(grid, prefixes) if prefixes else None)
    graphs = len(shapes) if shapes else len(grid)
    if args.json:
        _print_json("show", {"grid": grid, "graphs": graphs,
                             "shapes": [list(s) for s in shapes] if shapes else None})
        return 0
    print(f"{len(grid)} buckets: {grid}")
    if shapes:
        kind = "(batch, length)" if batches else "(active, prefix)"
        print(f"{graphs} {kind} graphs: {', '.join(str(s) for s in shapes)}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    grid = _grid(args, args.phase)
    if args.phase == "decode":
        need = decode_need(args.need, args.speculation)
        why_need = (f"decoding position {args.need} attends {need} positions (position + 1"
                    f"{f' + speculation {args.speculation}' if args.speculation else ''})")
    else:
        need = args.need
        why_need = f"context encoding computes {need} tokens"
    second = None
    if args.batch is not None:
        batches = _second(args, "--batches", "token_generation_batches", "--batch")
        second = ("batch", batch_grid(batches, grid), (args.batch, need))
    elif args.prefix_len is not None:
        prefixes = _second(args, "--prefix-buckets", "prefix_buckets", "--prefix-len")
        second = ("prefix", prefix_grid(grid, prefixes), (need, args.prefix_len))
    result: dict = {"need": need, "phase": args.phase, "grid": grid}
    try:
        if second:
            pair, shapes, full = second
            cost = _cost(args.cost, pair)
            bucket = fit_nd(shapes, full, cost=cost)
            fitting = [s for s in shapes if all(b >= n for b, n in zip(s, full))]
            result.update(need=list(full), bucket=list(bucket), shapes=len(shapes),
                          fitting=len(fitting), cost=round(cost(bucket), 6),
                          reason=f"least-cost of the {len(fitting)} shapes >= {full} in "
                                 f"every dimension ({cost.describe()})")
            text = [why_need, f"{pair} grid: {len(shapes)} shapes; need {full}",
                    f"fit: {bucket} - {result['reason']}; cost {cost(bucket):.2f} {cost.unit}"]
        else:
            bucket = first_fit(grid, need)
            below = [b for b in grid if b < need]
            reason = (f"smallest bucket >= {need}" +
                      (f" ({below[-1]} < {need})" if below else ""))
            result.update(bucket=bucket, padding=bucket - need, reason=reason)
            text = [why_need, f"grid: {grid}",
                    f"first fit: {bucket} - {reason}; pads {bucket - need} tokens "
                    f"({100 * (bucket - need) / bucket:.1f}% of the bucket)"]
            strict = strict_fit(grid, need)
            result.update(strict_bucket=strict, strict_padding=strict - need)
            note = (" - same" if strict == bucket else
                    f" - NxDI takes the first bucket > {need}, skipping {bucket}, and pads "
                    f"{strict - bucket} more tokens")
            text.append(f"NxDI strict (<): {strict}{note}")
    except NoFitError as exc:
        result.update(bucket=None, error=str(exc))
        text = [why_need, f"no fit: {exc}"]
        code = 1
    else:
        code = 0
    if args.json:
        _print_json("fit", result)
    else:
        print("\n".join(text))
    return code


def _replay(args: argparse.Namespace) -> int:
    workload, data = _workload_needs(args)
    grid = _grid(args, args.phase)
    cost = _cost(args.cost, args.pair)
    if args.pair:
        flag, key = (("--batches", "token_generation_batches") if args.pair == "batch"
                     else ("--prefix-buckets", "prefix_buckets"))
        other = _second(args, flag, key, f"--pair {args.pair}")
        shapes = batch_grid(other, grid) if args.pair == "batch" else prefix_grid(grid, other)
        report = report_2d(shapes, *data, pair=args.pair, cost=cost)
        baseline = report_2d(_baseline_2d(args.pair, grid[-1], other[-1]), *data,
                             pair=args.pair, cost=cost)
        comparison = compare(report, baseline)
    else:
        report, baseline, comparison = against_nxdi(grid, data, cost=cost, rule=args.rule)
    if args.json:
        _print_json("replay", {"workload": _workload_summary(args, workload, report),
                               "report": report.to_dict(),
                               "baseline": {"name": "nxdi_default", **baseline.to_dict()},
                               "comparison": comparison})
        return 0
    print(f"{args.trace}: {workload.requests:,} requests, {args.phase} phase; grid "
          f"{report.grid} ({report.rule}); cost: {report.cost_model}")
    print(_table(report))
    print(_comparison_line(comparison, f"NxDI's default grid {baseline.grid}"))
    return 0


def _tune(args: argparse.Namespace) -> int:
    workload, data = _workload_needs(args)
    cost = _cost(args.cost, args.pair)
    graphs = None
    if args.compile_budget is not None or args.seconds_per_graph is not None:
        if args.compile_budget is None or args.seconds_per_graph is None:
            raise BucketError("--compile-budget and --seconds-per-graph go together; pass both")
        graphs = buckets_within_budget(args.compile_budget, args.seconds_per_graph)
    lists: dict[str, list[int]] = {}
    if args.pair:
        if args.pair == "batch":
            if args.max_num_seqs is None:
                raise BucketError("--pair batch needs --max-num-seqs (the largest batch)")
            limits = (args.max_batch_buckets, args.max_buckets)
            maxima, align = (args.max_num_seqs, args.max), (None, args.align)
        else:
            limits = (args.max_buckets, args.max_prefix_buckets)
            maxima, align = (args.max, args.max), (args.align, args.align)
        first, second = tune_2d(*data, limits, maxima=maxima, pair=args.pair, cost=cost,
                                align=align, max_graphs=graphs)
        if args.pair == "batch":
            lists = {PHASE_KEYS[args.phase]: second, "token_generation_batches": first}
            shapes = batch_grid(first, second)
        else:
            lists = {"context_encoding_buckets": first,
                     "prefix_buckets": [p for p in second if p]}
            shapes = prefix_grid(first, second)
        report = report_2d(shapes, *data, pair=args.pair, cost=cost)
        baseline = report_2d(_baseline_2d(args.pair, args.max, args.max_num_seqs), *data,
                             pair=args.pair, cost=cost)
        comparison = compare(report, baseline)
    else:
        limit = min(args.max_buckets, graphs) if graphs else args.max_buckets
        grid = tune_1d(data, limit, maximum=args.max, cost=cost, align=args.align)
        lists = {PHASE_KEYS[args.phase]: grid}
        report, baseline, comparison = against_nxdi(grid, data, cost=cost)
    if args.output:
        command = "neuron-buckets " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        dump_bucket_set(args.output, **lists, description=(
            f"tuned by neuron-buckets on {args.trace} ({workload.requests} requests, "
            f"{args.phase} phase): padded tokens {comparison['padded_tokens_saved_pct']}% "
            f"below NxDI's default grid"), comment=f"generated by: {command}")
    if args.json:
        _print_json("tune", {"workload": _workload_summary(args, workload, report),
                             "limits": {"max": args.max, "max_buckets": args.max_buckets,
                                        "align": args.align, "max_graphs": graphs,
                                        "cost": args.cost},
                             "buckets": lists, "report": report.to_dict(),
                             "baseline": {"name": "nxdi_default", **baseline.to_dict()},
                             "comparison": comparison,
                             "output": str(args.output) if args.output else None})
        return 0
    for key, values in lists.items():
        print(f"{key}: {values}")
    print(_table(report))
    print(_comparison_line(comparison, f"NxDI's default grid {baseline.grid}"))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .plot import plot_grid

    workload, hist = _workload_needs(args)
    grid = _grid(args, args.phase)
    report = report_1d(grid, hist, cost=_cost(args.cost))
    written = plot_grid(args.output, hist, grid, report,
                        title=f"{args.trace.name}: {workload.requests:,} requests, "
                              f"{args.phase} needs, grid {grid}")
    print(f"wrote {written}")
    return 0
