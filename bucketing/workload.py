"""Workloads and what they need from a grid.

A ``Workload`` holds per-request sizes (one row per trace record, or one row per
distinct length with a count when it comes from a histogram). The *needs* functions turn
it into what each compiled graph must hold, using the fit rule's definitions in
``fit.py``: context encoding needs the tokens to compute, token generation needs
``full_context_len`` positions at every decode step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import BucketError
from .fit import context_need, decode_need

PHASES = ("context", "decode")


class Histogram(NamedTuple):
    """Distinct needs in increasing order and how many times each occurs."""

    values: np.ndarray
    counts: np.ndarray


def histogram(
    values: Sequence[int] | np.ndarray, counts: Sequence[int] | np.ndarray | None = None
) -> Histogram:
    """Sum ``counts`` (default 1 each) per distinct value; zero counts are dropped."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    counts = (
        np.ones_like(values) if counts is None else np.asarray(counts, dtype=np.int64).reshape(-1)
    )
    distinct, inverse = np.unique(values, return_inverse=True)
    totals = np.bincount(inverse, weights=counts, minlength=len(distinct)).astype(np.int64)
    keep = totals > 0
    return Histogram(distinct[keep], totals[keep])


@dataclass(frozen=True)
class Workload:
    """Per-request sizes; optional columns are None when the source lacks them."""

    prompt_tokens: np.ndarray
    counts: np.ndarray
    output_tokens: np.ndarray | None = None
    batch: np.ndarray | None = None
    prefix_hit_tokens: np.ndarray | None = None
    source: str = ""
    # When each request arrived, in seconds from the first (a trace's timestamps).
    arrival_s: np.ndarray | None = None

    @property
    def requests(self) -> int:
        return int(self.counts.sum())


# What the analysis functions accept as a workload.
WorkloadLike = Workload | Histogram | Mapping[int, int] | Sequence[int] | np.ndarray


def as_workload(data: WorkloadLike, source: str = "") -> Workload:
    """Accept a Workload, a Histogram, a {length: count} mapping or a list of prompt lengths."""
    if isinstance(data, Workload):
        return data
    values: Sequence[int] | np.ndarray
    counts: Sequence[int] | np.ndarray | None
    if isinstance(data, Histogram):
        values, counts = data
    elif isinstance(data, Mapping):
        values, counts = list(data.keys()), list(data.values())
    else:
        values, counts = data, None
    hist = histogram(values, counts)
    if hist.values.size == 0:
        raise BucketError("the workload is empty; give at least one request length")
    if hist.values[0] < 0:
        raise BucketError(
            f"request length {int(hist.values[0])} is negative; lengths are token counts >= 0"
        )
    return Workload(prompt_tokens=hist.values, counts=hist.counts, source=source)


def context_needs(workload: Workload, *, prefix_caching: bool = False) -> Histogram:
    """Tokens each context encoding computes: the prompt, minus the prefix-cache hit when
    ``prefix_caching`` (which then requires the trace's prefix_hit_tokens)."""
    computed = _column(workload, "prefix_hit_tokens") if prefix_caching else 0
    return histogram(context_need(workload.prompt_tokens, computed), workload.counts)


def decode_needs(workload: Workload, *, speculation_length: int = 0) -> Histogram:
    """``full_context_len`` (+ speculation) of every decode step of every request.

    A request with p prompt tokens and o output tokens gets its first output token from
    the context encoding and decodes the other o - 1 at positions p .. p + o - 2, so it
    needs p + 1 .. p + o - 1 positions (plus the speculation length). Computed with a
    difference array, so a trace of long outputs costs no per-step loop. Empty when no
    request decodes.
    """
    outputs = _column(workload, "output_tokens")
    steps = outputs >= 2
    first = decode_need(workload.prompt_tokens[steps], speculation_length)
    last = first + outputs[steps] - 2
    counts = workload.counts[steps]
    if first.size == 0:
        return Histogram(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    delta = np.zeros(int(last.max()) + 2, dtype=np.int64)
    np.add.at(delta, first, counts)
    np.add.at(delta, last + 1, -counts)
    per_need = np.cumsum(delta)[:-1]
    needs = np.flatnonzero(per_need)
    return Histogram(needs.astype(np.int64), per_need[needs])


def needs(
    workload: Workload,
    phase: str = "context",
    *,
    prefix_caching: bool = False,
    speculation_length: int = 0,
) -> Histogram:
    """The 1-D needs of ``phase`` ("context" or "decode")."""
    if phase == "context":
        return context_needs(workload, prefix_caching=prefix_caching)
    if phase == "decode":
        return decode_needs(workload, speculation_length=speculation_length)
    raise BucketError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")


def paired_needs(
    workload: Workload, pair: str, phase: str = "context", *, speculation_length: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """2-D needs as (distinct rows, counts).

    pair "batch": (batch size, length need of ``phase``) for batch-bucketed grids;
    pair "prefix": (tokens to compute, prefix-cache hit) for prefix-caching grids
    (context phase only: decode steps use the 1-D token-generation grid).
    """
    if pair == "prefix":
        if phase != "context":
            raise BucketError("prefix pairs describe context encoding; use --phase context")
        hits = _column(workload, "prefix_hit_tokens")
        rows = np.stack([context_need(workload.prompt_tokens, hits), hits], axis=1)
        return _unique_rows(rows, workload.counts)
    if pair != "batch":
        raise BucketError(f"unknown pair {pair!r}; choose batch or prefix")
    batches = _column(workload, "batch")
    parts = []
    for size in np.unique(batches):
        rows = batches == size
        subset = Workload(
            workload.prompt_tokens[rows],
            workload.counts[rows],
            output_tokens=_subset(workload.output_tokens, rows),
            prefix_hit_tokens=_subset(workload.prefix_hit_tokens, rows),
        )
        hist = needs(subset, phase, speculation_length=speculation_length)
        parts.append((np.column_stack([np.full(hist.values.size, size), hist.values]), hist.counts))
    return _unique_rows(
        np.concatenate([p for p, _ in parts]), np.concatenate([c for _, c in parts])
    )


def concurrency(workload: Workload, *, ms_per_token: float, max_num_seqs: int) -> np.ndarray:
    """Each request's decode batch from the trace's arrival times: the mean number of
    requests in flight over its own time in flight (itself included), rounded, between 1
    and max_num_seqs (more wait in vLLM's queue). A request is in flight from its arrival
    for output_tokens x ms_per_token (at least one token's time): the decode pace the
    server is expected to keep, which the trace does not record."""
    arrivals = _column(workload, "arrival_s").astype(np.float64)
    outputs = _column(workload, "output_tokens")
    if not ms_per_token > 0:
        raise BucketError(f"ms_per_token must be above 0, got {ms_per_token!r}; e.g. 25")
    if max_num_seqs < 1:
        raise BucketError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    ends = arrivals + np.maximum(outputs, 1) * ms_per_token / 1000.0
    times = np.concatenate([arrivals, ends])
    steps = np.concatenate([np.ones_like(arrivals), -np.ones_like(ends)])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(steps[order])
    # the integral of the number in flight up to each event (piecewise linear between)
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])
    mean = (np.interp(ends, times, area) - np.interp(arrivals, times, area)) / (ends - arrivals)
    return np.clip(np.rint(mean), 1, max_num_seqs).astype(np.int64)


def _unique_rows(rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    distinct, inverse = np.unique(rows.astype(np.int64), axis=0, return_inverse=True)
    totals = np.bincount(inverse.reshape(-1), weights=counts, minlength=len(distinct))
    return distinct, totals.astype(np.int64)


def _subset(column: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    return None if column is None else column[rows]


def _column(workload: Workload, name: str) -> np.ndarray:
    column = getattr(workload, name)
    if column is None:
        raise BucketError(
            f"the workload {workload.source or ''} has no {name}; record it in "
            f"the trace (JSONL field {name!r}) or choose an analysis that "
            f"does not need it"
        )
    return column
