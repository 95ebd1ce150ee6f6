"""``neuron-buckets tune TRACE``: the least-cost grid for real traffic, one phase or both
(``--phase both`` writes context-encoding and token-generation keys into one bucket set,
the file ``bucket_set`` reads)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import BucketError
from ..files import dump_bucket_set
from ..grids import batch_grid, prefix_grid
from ..report import Report
from ..trace import read_lengths
from ..tune import buckets_within_budget, tune_1d, tune_2d
from ..workload import PHASES, Histogram, Workload, concurrency
from .arguments import against_default, cost_model, phase_needs
from .options import PHASE_KEYS, cost_option, json_option, trace_options
from .output import print_json, print_report, workload_summary

# A decode pace for traces without one: the single-user inter-token latency published for
# Llama-3.1-8B on inf2.48xlarge (TP8, optimum-neuron's benchmarks), ~24.5 ms.
DEFAULT_MS_PER_TOKEN = 25.0
# --pair with --phase both: the phase whose graphs the second dimension belongs to.
PAIR_PHASE = {"batch": "decode", "prefix": "context"}


@dataclass(frozen=True)
class Tuned:
    """One phase's result: its override keys, report, NxDI baseline and comparison."""

    phase: str
    pair: str | None
    lists: dict[str, list[int]]
    report: Report
    baseline: Report
    comparison: dict

    def to_json(self) -> dict:
        """The report/baseline/comparison part of tune's stable JSON."""
        return {
            "report": self.report.to_dict(),
            "baseline": {"name": "nxdi_default", **self.baseline.to_dict()},
            "comparison": self.comparison,
        }


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Register ``tune`` and its flags."""
    parser = verbs.add_parser(
        "tune",
        help="tune a grid to a trace or histogram",
        description="Find the grid of at most K buckets (largest = "
        "--max) with least expected cost on the trace; "
        "exact for 1-D, alternating exact solves for 2-D "
        "(--pair). --phase both tunes context encoding "
        "and token generation into one bucket set.",
    )
    trace_options(parser, phases=(*PHASES, "both"))
    parser.add_argument(
        "--max",
        type=int,
        required=True,
        metavar="N",
        help="largest bucket: max_model_len (or max context length)",
    )
    parser.add_argument(
        "--max-buckets",
        "-k",
        type=int,
        default=6,
        metavar="K",
        help="at most K buckets in the length dimension, per phase (default 6)",
    )
    parser.add_argument(
        "--align", type=int, metavar="A", help="buckets must be multiples of A (the KV block size)"
    )
    parser.add_argument(
        "--max-batch-buckets",
        type=int,
        default=3,
        metavar="K",
        help="--pair batch: at most K batch buckets (default 3)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, metavar="N", help="--pair batch: largest batch bucket"
    )
    parser.add_argument(
        "--ms-per-token",
        type=float,
        default=DEFAULT_MS_PER_TOKEN,
        metavar="MS",
        help="--pair batch on a trace without batch but with arrival times (the Azure "
        "trace's TIMESTAMP): each request is in flight for output_tokens x MS, and its "
        f"decode batch is the mean number in flight meanwhile (default {DEFAULT_MS_PER_TOKEN:g})",
    )
    parser.add_argument(
        "--max-prefix-buckets",
        type=int,
        default=4,
        metavar="K",
        help="--pair prefix: at most K prefix buckets, prefix 0 included (default 4)",
    )
    parser.add_argument(
        "--compile-budget",
        type=float,
        metavar="SECONDS",
        help="cap the number of graphs to what this compile time pays for "
        "(needs --seconds-per-graph; --phase both shares it equally)",
    )
    parser.add_argument(
        "--seconds-per-graph",
        type=float,
        metavar="SECONDS",
        help="measured compile time of one graph",
    )
    parser.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="FILE",
        help="write the tuned bucket set (.yaml, .yml or .json)",
    )
    cost_option(parser)
    json_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Tune, print, and write the bucket set when asked; exit code 0."""
    workload = read_lengths(args.trace)
    if args.pair == "batch":
        workload = _with_batches(args, workload)
    phases = PHASES if args.phase == "both" else (args.phase,)
    graphs = _graph_budget(args, len(phases))
    results = [_tune_phase(args, workload, phase, _pair(args, phase), graphs) for phase in phases]
    lists = {key: values for result in results for key, values in result.lists.items()}
    if args.output:
        _write(args, workload, results, lists)
    if args.json:
        body = {
            "workload": workload_summary(
                args,
                workload,
                args.phase,
                sum(r.report.served + r.report.rejected for r in results),
            ),
            "limits": {
                "max": args.max,
                "max_buckets": args.max_buckets,
                "align": args.align,
                "max_graphs": graphs,
                "cost": args.cost,
            },
            "buckets": lists,
            "phases": {r.phase: {"pair": r.pair, **r.to_json()} for r in results},
            "output": str(args.output) if args.output else None,
        }
        if len(results) == 1:
            body.update(results[0].to_json())
        print_json("tune", body)
        return 0
    for result in results:
        if len(results) > 1:
            print(f"{result.phase} phase:")
        for key, values in result.lists.items():
            print(f"{key}: {values}")
        print_report(result.report, result.baseline, result.comparison)
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _with_batches(args: argparse.Namespace, workload: Workload) -> Workload:
    """The workload with each request's decode batch: the trace's own (the plugin's
    request trace records it), else derived from its arrival times (`concurrency`)."""
    if workload.batch is not None:
        return workload
    if args.max_num_seqs is None:
        raise BucketError("--pair batch needs --max-num-seqs (the largest batch)")
    if workload.arrival_s is None:
        raise BucketError(
            f"{args.trace} records neither each request's decode batch (batch) nor its "
            f"arrival (TIMESTAMP, arrival_s), so --pair batch has no concurrency to "
            f"learn from; record traffic with VLLM_NEURON_TRACE=FILE (its records carry "
            f"batch), or give a trace with arrival times"
        )
    batches = concurrency(workload, ms_per_token=args.ms_per_token, max_num_seqs=args.max_num_seqs)
    return dataclasses.replace(workload, batch=batches)


def _pair(args: argparse.Namespace, phase: str) -> str | None:
    """--pair for one phase: as given for a single phase; with --phase both only for the
    phase its second dimension belongs to (batch: decode, prefix: context)."""
    if args.phase != "both" or PAIR_PHASE.get(args.pair) == phase:
        return args.pair
    return None


def _graph_budget(args: argparse.Namespace, phases: int) -> int | None:
    """Graphs per phase the compile budget pays for (None without a budget)."""
    if args.compile_budget is None and args.seconds_per_graph is None:
        return None
    if args.compile_budget is None or args.seconds_per_graph is None:
        raise BucketError("--compile-budget and --seconds-per-graph go together; pass both")
    graphs = buckets_within_budget(args.compile_budget, args.seconds_per_graph) // phases
    if graphs < 1:
        raise BucketError(
            f"--compile-budget {args.compile_budget} pays for fewer than one "
            f"graph per phase at {args.seconds_per_graph} s each; raise it or "
            f"tune one --phase"
        )
    return graphs


def _tune_phase(
    args: argparse.Namespace, workload: Workload, phase: str, pair: str | None, graphs: int | None
) -> Tuned:
    data = phase_needs(args, workload, phase, pair)
    cost = cost_model(args.cost, pair)
    if pair == "batch":
        if args.max_num_seqs is None:
            raise BucketError("--pair batch needs --max-num-seqs (the largest batch)")
        batches, lengths = tune_2d(
            *data,
            (args.max_batch_buckets, args.max_buckets),
            maxima=(args.max_num_seqs, args.max),
            pair=pair,
            cost=cost,
            align=(None, args.align),
            max_graphs=graphs,
        )
        lists = {PHASE_KEYS[phase]: lengths, "token_generation_batches": batches}
        shapes = batch_grid(batches, lengths)
    elif pair == "prefix":
        active, prefixes = tune_2d(
            *data,
            (args.max_buckets, args.max_prefix_buckets),
            maxima=(args.max, args.max),
            pair=pair,
            cost=cost,
            align=(args.align, args.align),
            max_graphs=graphs,
        )
        lists = {"context_encoding_buckets": active, "prefix_buckets": [p for p in prefixes if p]}
        shapes = prefix_grid(active, prefixes)
    else:
        limit = min(args.max_buckets, graphs) if graphs else args.max_buckets
        lengths = tune_1d(Histogram(*data), limit, maximum=args.max, cost=cost, align=args.align)
        return Tuned(
            phase, pair, {PHASE_KEYS[phase]: lengths}, *against_default(lengths, data, cost, pair)
        )
    return Tuned(phase, pair, lists, *against_default(shapes, data, cost, pair))


def _write(
    args: argparse.Namespace, workload: Workload, results: list[Tuned], lists: dict[str, list[int]]
) -> None:
    """The bucket set, headed by the command that produced it."""
    command = "neuron-buckets " + shlex.join(args.argv)
    if len(results) == 1:
        phases, grids = f"{results[0].phase} phase", "grid"
        saved = f"{results[0].comparison['padded_tokens_saved_pct']}%"
    else:
        phases, grids = " and ".join(r.phase for r in results) + " phases", "grids"
        saved = ", ".join(
            f"{r.comparison['padded_tokens_saved_pct']}% ({r.phase})" for r in results
        )
    dump_bucket_set(
        args.output,
        **lists,
        description=(
            f"tuned by neuron-buckets on {args.trace} ({workload.requests} requests, {phases}): "
            f"padded tokens {saved} below NxDI's default {grids}"
        ),
        comment=f"generated by: {command}",
    )
