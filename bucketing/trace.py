"""Reading request traces and histograms into a ``Workload``.

Accepted inputs (see docs/reference/neuron-buckets.md):

- JSON Lines, one request per line: ``prompt_tokens`` (required), optional
  ``output_tokens``, ``batch``, ``prefix_hit_tokens``, ``arrival_s`` (seconds); any
  other field (``bucket``, ``ttft_ms``, ``request_id`` ...) is ignored. This is what the
  plugin's telemetry writes.
- CSV with a header: the Azure LLM inference trace columns ``TIMESTAMP`` (arrival),
  ``ContextTokens`` / ``GeneratedTokens``, or the JSONL field names; other columns are
  ignored.

Arrival times are kept as seconds from the first request (``Workload.arrival_s``), from
which ``workload.concurrency`` derives decode batches where the trace records none.
- A plain list: one integer prompt length per line (blank lines and ``#`` comments skipped).
- A histogram document (.yaml/.yml/.json): ``{histogram: {length: count, ...}}``.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BucketFileError
from .fileio import SUFFIXES, check_keys, load_document, whole_number
from .workload import Workload, as_workload

FIELDS = {"prompt_tokens": 1, "output_tokens": 0, "batch": 1, "prefix_hit_tokens": 0}
ARRIVAL = "arrival_s"
CSV_ALIASES = {
    "ContextTokens": "prompt_tokens",
    "GeneratedTokens": "output_tokens",
    "TIMESTAMP": ARRIVAL,
}


def read_lengths(path: str | Path) -> Workload:
    """The workload in ``path``, whichever accepted format it is in."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise BucketFileError(
            path, None, f"cannot be read ({exc.strerror}); check the path"
        ) from None
    first = next(
        (
            line.strip()
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ),
        "",
    )
    if path.suffix.lower() in SUFFIXES and not _is_json_lines(path, text, first):
        return _histogram_document(path)
    if not first:
        raise BucketFileError(path, None, "holds no requests; give one request per line")
    if first.startswith("{") or path.suffix.lower() == ".jsonl":
        return _records(path, _json_lines(path, text))
    if "," in first:
        return _records(path, _csv_rows(path, text))
    return _plain_list(path, text)


def _is_json_lines(path: Path, text: str, first: str) -> bool:
    """A .json file that is really JSON Lines (one object per line) is read as such."""
    if path.suffix.lower() != ".json" or not first.startswith("{"):
        return False
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return True
    return False


def _json_lines(path: Path, text: str) -> Iterable[tuple[str, dict[str, Any]]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BucketFileError(
                path,
                f"line {number}",
                f"is not a JSON object ({exc.msg}); write one object per line",
            ) from None
        if not isinstance(record, dict):
            raise BucketFileError(path, f"line {number}", f"must be a JSON object, got {record!r}")
        yield f"line {number}", record


def _csv_rows(path: Path, text: str) -> Iterable[tuple[str, dict[str, Any]]]:
    reader = csv.DictReader(io.StringIO(text))
    columns = {CSV_ALIASES.get(name, name) for name in reader.fieldnames or ()}
    if "prompt_tokens" not in columns:
        raise BucketFileError(
            path,
            "header",
            f"has no prompt-length column (got "
            f"{reader.fieldnames}); name it ContextTokens "
            f"or prompt_tokens",
        )
    for number, row in enumerate(reader, start=2):
        record: dict[str, Any] = {}
        for name, value in row.items():
            field = CSV_ALIASES.get(name, name)
            if field in FIELDS and value not in (None, ""):
                record[field] = _csv_int(value)
            elif field == ARRIVAL and value not in (None, ""):
                record[field] = _timestamp(path, number, name, value)
        yield f"line {number}", record


def _timestamp(path: Path, number: int, column: str, value: str) -> float:
    """A CSV arrival as seconds: a number of seconds, or a date and time
    ("2023-11-16 18:15:46.6805900", the Azure trace's) as seconds since the epoch."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        stamp = np.datetime64(value.strip().replace(" ", "T"), "ns")
    except ValueError:
        raise BucketFileError(
            path,
            f"line {number}: {column}",
            f"{value!r} is neither seconds nor a date and time like 2023-11-16 18:15:46.68",
        ) from None
    return float(stamp.astype(np.int64)) / 1e9


def _csv_int(value: str) -> int | str:
    """The cell as an int; a non-number is passed on so _records reports it by field."""
    try:
        return int(value)
    except ValueError:
        return value


def _records(path: Path, rows: Iterable[tuple[str, dict[str, Any]]]) -> Workload:
    columns: dict[str, list[int]] = {name: [] for name in FIELDS}
    arrivals: list[float] = []
    missing: dict[str, str] = {}
    count = 0
    for where, record in rows:
        count += 1
        arrival = record.get(ARRIVAL)
        if arrival is not None:
            if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
                raise BucketFileError(
                    path, f"{where}: {ARRIVAL}", f"{arrival!r} is not a number of seconds"
                )
            arrivals.append(float(arrival))
        else:
            missing.setdefault(ARRIVAL, where)
        values = {
            name: whole_number(path, f"{where}: {name}", record[name], minimum)
            for name, minimum in FIELDS.items()
            if record.get(name) is not None
        }
        if "prompt_tokens" not in values:
            raise BucketFileError(
                path, f"{where}: prompt_tokens", "is missing; every request needs its prompt length"
            )
        for name in FIELDS:
            if name in values:
                columns[name].append(values[name])
            else:
                missing.setdefault(name, where)
        if values.get("prefix_hit_tokens", 0) > values["prompt_tokens"]:
            raise BucketFileError(
                path,
                f"{where}: prefix_hit_tokens",
                f"{values['prefix_hit_tokens']} is more than prompt_tokens "
                f"{values['prompt_tokens']}; a cache hit is part of the "
                f"prompt",
            )
    if count == 0:
        raise BucketFileError(path, None, "holds no requests; give one request per line")
    optional = {}
    for name in ("output_tokens", "batch", "prefix_hit_tokens"):
        if columns[name] and name in missing:
            raise BucketFileError(
                path,
                f"{missing[name]}: {name}",
                f"is missing although other requests have it; record "
                f"{name} for every request or for none",
            )
        optional[name] = np.array(columns[name], dtype=np.int64) if columns[name] else None
    if arrivals and ARRIVAL in missing:
        raise BucketFileError(
            path,
            f"{missing[ARRIVAL]}: {ARRIVAL}",
            "is missing although other requests have it; record the arrival of every "
            "request or of none",
        )
    prompts = np.array(columns["prompt_tokens"], dtype=np.int64)
    arrival_s = None
    if arrivals:
        arrival_s = np.array(arrivals, dtype=np.float64)
        arrival_s -= arrival_s.min()
    return Workload(
        prompt_tokens=prompts,
        counts=np.ones_like(prompts),
        source=str(path),
        arrival_s=arrival_s,
        **optional,
    )


def _plain_list(path: Path, text: str) -> Workload:
    lengths = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            value = int(line)
        except ValueError:
            raise BucketFileError(
                path,
                f"line {number}",
                f"{line!r} is not a whole number; a plain trace lists one prompt length per line",
            ) from None
        lengths.append(whole_number(path, f"line {number}", value, 1))
    return as_workload(lengths, source=str(path))


def _histogram_document(path: Path) -> Workload:
    data = load_document(path)
    check_keys(path, data, ("histogram", "source"), required=("histogram",))
    table = data["histogram"]
    if not isinstance(table, dict) or not table:
        raise BucketFileError(
            path, "histogram", "must map prompt lengths to request counts, e.g. {97: 300, 120: 40}"
        )
    hist: dict[int, int] = {}
    for key, count in table.items():
        try:
            length = int(key)
        except (TypeError, ValueError):
            length = key
        length = whole_number(path, f"histogram key {key!r}", length, 1)
        hist[length] = whole_number(path, f"histogram[{key!r}]", count, 1)
    return as_workload(hist, source=str(path))
