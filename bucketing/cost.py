"""Cost models: the expected latency of running one bucket, as a function of its shape.

The tuner minimises expected cost, and ``fit_nd`` picks the least-cost fitting bucket,
so a measured table (bucket -> ms) turns both into decisions about real time. Without
one, ``LinearQuadraticCost`` stands in: fixed overhead + a per-token term (weights,
MLP) + a term per token pair (attention), in padded tokens.

Its default coefficients are calibrated on the two context-encoding points of the
profiling study in NEURON_FINDINGS.md (inf2.xlarge, Qwen3-0.6B, TP 2, batch 4): a
128-token bucket in 13.4 ms and the 2048-token graph in 211 ms. Two points cannot
separate the linear from the quadratic part, so 15% of the 2048 cost is assigned to
attention (an assumption); replace it with a measured table when you have one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import BucketError, BucketFileError
from .fileio import check_keys, dump_document, load_document, positive_number, whole_number

PHASES = (
    "context_encoding",
    "token_generation",
    "prefix_context_encoding",
    "chunked_prefill",
    "vision_encoding",
)
LAYOUTS = ("tokens", "active_prefix")
TABLE_KEYS = ("unit", "phase", "source", "buckets")
ENTRY_KEYS = ("shape", "ms", "samples")


class CostModel(ABC):
    """Cost of one bucket. ``cost(shape)``; also callable, so it plugs into ``fit_nd``."""

    unit = "ms"

    @abstractmethod
    def cost(self, shape: tuple[int, ...]) -> float:
        """Expected cost of running one step in the bucket ``shape``."""

    def costs(self, shapes: np.ndarray) -> np.ndarray:
        """Cost of each row of an (n, rank) array of shapes."""
        return np.array([self.cost(tuple(int(v) for v in row)) for row in shapes], dtype=float)

    def __call__(self, shape: tuple[int, ...]) -> float:
        return self.cost(shape)

    @abstractmethod
    def describe(self) -> str:
        """One line for reports: which model produced the numbers."""


@dataclass(frozen=True)
class LinearQuadraticCost(CostModel):
    """ms = fixed + per_token * tokens + per_pair * tokens * span.

    layout "tokens": tokens = product of the dimensions, span = the last dimension
    ([seq] -> seq and seq**2; [batch, seq] -> batch*seq and batch*seq**2).
    layout "active_prefix" (prefix-caching grids): tokens = active, span = active + prefix.
    """

    fixed_ms: float = 2.2
    per_token_ms: float = 0.0865
    per_pair_ms: float = 7.5e-6
    layout: str = "tokens"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise BucketError(
                f"cost layout {self.layout!r} is unknown; choose one of {', '.join(LAYOUTS)}"
            )

    def cost(self, shape: tuple[int, ...]) -> float:
        return float(self.costs(np.asarray([shape]))[0])

    def costs(self, shapes: np.ndarray) -> np.ndarray:
        shapes = np.asarray(shapes, dtype=float)
        if self.layout == "active_prefix":
            tokens, span = shapes[:, 0], shapes[:, 0] + shapes[:, 1]
        else:
            tokens, span = np.prod(shapes, axis=1), shapes[:, -1]
        return self.fixed_ms + self.per_token_ms * tokens + self.per_pair_ms * tokens * span

    def describe(self) -> str:
        return (
            f"linear+quadratic latency model ({self.layout}): {self.fixed_ms} + "
            f"{self.per_token_ms}*tokens + {self.per_pair_ms}*tokens*span ms"
        )


class PaddedTokenCost(CostModel):
    """Cost = tokens computed (product of the dimensions): minimising it minimises padding."""

    unit = "tokens"

    def cost(self, shape: tuple[int, ...]) -> float:
        return float(math.prod(shape))

    def costs(self, shapes: np.ndarray) -> np.ndarray:
        return np.prod(np.asarray(shapes, dtype=float), axis=1)

    def describe(self) -> str:
        return "padded tokens (product of the bucket's dimensions)"


@dataclass(frozen=True)
class TableCost(CostModel):
    """Measured milliseconds per bucket shape.

    Lookup of a shape that was not measured, along the last dimension among measured
    shapes that agree on every other dimension: between two measured lengths, linear
    interpolation; below the shortest, the shortest's time (a graph is never cheaper
    than the overhead measured for the smallest one); above the longest, or with no
    measured shape sharing the other dimensions, a BucketError asking for the measurement.
    """

    phase: str
    table: Mapping[tuple[int, ...], float]
    source: str = ""
    _rows: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        rows: dict[tuple[int, ...], list[tuple[int, float]]] = {}
        for shape, ms in sorted(self.table.items()):
            rows.setdefault(shape[:-1], []).append((shape[-1], ms))
        object.__setattr__(
            self,
            "_rows",
            {
                key: (np.array([n for n, _ in pts], dtype=float), np.array([ms for _, ms in pts]))
                for key, pts in rows.items()
            },
        )

    def cost(self, shape: tuple[int, ...]) -> float:
        shape = tuple(shape)
        if shape in self.table:
            return float(self.table[shape])
        row = self._rows.get(shape[:-1])
        if row is None or shape[-1] > row[0][-1]:
            known = ", ".join(str(list(s)) for s in sorted(self.table))
            raise BucketError(
                f"cost table {self.source or self.phase} has no timing for "
                f"shape {list(shape)} and cannot interpolate it (measured: "
                f"{known}); measure that bucket or a larger one with the same "
                f"other dimensions"
            )
        lengths, ms = row
        return float(np.interp(shape[-1], lengths, ms))

    def describe(self) -> str:
        return (
            f"measured table ({self.phase}, {len(self.table)} shapes, {self.source or 'no source'})"
        )


DEFAULT_COST = LinearQuadraticCost()


def load_cost_table(path: str | Path) -> TableCost:
    """A TableCost from the YAML/JSON format in docs/reference/neuron-buckets.md."""
    return _parse_table(path, load_document(path))


def _parse_table(path: str | Path, data: dict) -> TableCost:
    check_keys(path, data, TABLE_KEYS, required=("unit", "phase", "buckets"))
    if data["unit"] != "ms":
        raise BucketFileError(
            path, "unit", f'must be "ms", got {data["unit"]!r}; convert the timings to milliseconds'
        )
    if data["phase"] not in PHASES:
        raise BucketFileError(
            path, "phase", f"must be one of {', '.join(PHASES)}, got {data['phase']!r}"
        )
    source = data.get("source", "")
    if not isinstance(source, str):
        raise BucketFileError(path, "source", f"must be a string, got {source!r}")
    entries = data["buckets"]
    if not isinstance(entries, list) or not entries:
        raise BucketFileError(
            path, "buckets", "must be a non-empty list of {shape: [...], ms: ...} entries"
        )
    table: dict[tuple[int, ...], float] = {}
    for index, entry in enumerate(entries):
        key = f"buckets[{index}]"
        if not isinstance(entry, dict):
            raise BucketFileError(path, key, f"must be a mapping with shape and ms, got {entry!r}")
        check_keys(path, entry, ENTRY_KEYS, required=("shape", "ms"), where=f"{key}.")
        shape = _shape(path, f"{key}.shape", entry["shape"])
        if table and len(shape) != len(next(iter(table))):
            raise BucketFileError(
                path,
                f"{key}.shape",
                f"has {len(shape)} dimensions but "
                f"earlier shapes have "
                f"{len(next(iter(table)))}; one "
                f"table holds one phase's shapes",
            )
        if shape in table:
            raise BucketFileError(
                path, f"{key}.shape", f"{list(shape)} is listed twice; keep one timing per shape"
            )
        if "samples" in entry:
            whole_number(path, f"{key}.samples", entry["samples"], 1)
        table[shape] = positive_number(path, f"{key}.ms", entry["ms"])
    return TableCost(phase=data["phase"], table=table, source=source or str(path))


def _shape(path: str | Path, key: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise BucketFileError(path, key, f"must be a non-empty list of sizes, got {value!r}")
    # The first dimension is a length or a batch (>= 1); later ones may be a prefix (>= 0).
    return tuple(whole_number(path, key, v, 1 if axis == 0 else 0) for axis, v in enumerate(value))


def dump_cost_table(
    path: str | Path,
    *,
    phase: str,
    timings: Iterable[tuple[Iterable[int], float]],
    source: str = "",
    samples: int | None = None,
) -> Path:
    """Write measured timings in the cost-table format (for a measuring command); the
    document is validated first, so a table this writes always loads."""
    entries = [
        {
            "shape": [int(v) for v in shape],
            "ms": round(float(ms), 4),
            **({"samples": samples} if samples else {}),
        }
        for shape, ms in timings
    ]
    document = {"unit": "ms", "phase": phase, "source": source, "buckets": entries}
    _parse_table(path, document)
    return dump_document(
        path, document, comment="bucket -> ms cost table (see docs/reference/neuron-buckets.md)"
    )
