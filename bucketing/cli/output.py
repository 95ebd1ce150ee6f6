"""What the verbs print: the stable JSON envelope and the human-readable report."""

from __future__ import annotations

import argparse
import json

from ..report import Report
from ..workload import Workload

SCHEMA = "neuron-buckets/{}/v1"


def print_json(verb: str, body: dict) -> None:
    """One JSON document headed by the verb's schema name."""
    print(json.dumps({"schema": SCHEMA.format(verb), **body}, indent=2))


def workload_summary(args: argparse.Namespace, workload: Workload, phase: str, needs: int) -> dict:
    """The ``workload`` object of replay and tune JSON."""
    return {
        "source": str(args.trace),
        "requests": workload.requests,
        "phase": phase,
        "pair": args.pair,
        "prefix_caching": args.prefix_caching,
        "speculation": args.speculation,
        "needs": needs,
    }


def print_report(report: Report, baseline: Report, comparison: dict) -> None:
    """Per-bucket table, totals, and the comparison with NxDI's default grid."""
    print(_table(report))
    print(_comparison_line(comparison, f"NxDI's default grid {baseline.grid}"))


def _table(report: Report) -> str:
    lines = [
        f"{'bucket':>14} {'served':>9} {'share':>7} {'tokens':>13} {'padded':>13} "
        f"{'cost/' + report.cost_unit:>10}"
    ]
    for use in report.buckets:
        shape = use.bucket[0] if len(use.bucket) == 1 else "x".join(map(str, use.bucket))
        lines.append(
            f"{shape!s:>14} {use.served:>9} {100 * use.share:>6.1f}% "
            f"{use.tokens:>13,} {use.padded_tokens:>13,} {use.cost:>10.2f}"
        )
    lines.append(
        f"served {report.served:,} needs, rejected {report.rejected:,}; padded "
        f"{report.padded_tokens:,} tokens ({100 * report.padding_ratio:.1f}% of "
        f"computed, {report.padded_per_need:.1f} per need); expected cost "
        f"{report.expected_cost:.2f} {report.cost_unit} per need"
    )
    return "\n".join(lines)


def _comparison_line(comparison: dict, name: str) -> str:
    def change(pct: float | None, less: str, more: str) -> str:
        return "n/a" if pct is None else f"{abs(pct)}% {less if pct >= 0 else more}"

    return (
        f"vs {name}: padded tokens {comparison['padded_tokens']:,} vs "
        f"{comparison['baseline_padded_tokens']:,} "
        f"({change(comparison['padded_tokens_saved_pct'], 'fewer', 'more')}), expected "
        f"cost {change(comparison['expected_cost_saved_pct'], 'lower', 'higher')}"
    )
