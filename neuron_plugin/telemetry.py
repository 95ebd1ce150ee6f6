"""Per-bucket telemetry: which graph served each backend call, how much was padding, and
where the time went (backend forward vs host work around it).

Always on and cheap: a call adds to a few counters keyed by (phase, bucket). The engine
process publishes them as a small JSON snapshot (at most every PUBLISH_INTERVAL_S, and
whenever the batch drains) into a directory shared with the process that serves
`/metrics`; a Prometheus collector registered there reads the snapshots at scrape time.
That keeps vLLM's own metrics untouched (no multiprocess mode switch) and costs the
engine one small file write per interval. A compact per-bucket summary is logged
periodically and at shutdown. With `VLLM_NEURON_TRACE=FILE`, every finished request's
shape is appended to FILE as JSONL that `neuron-buckets tune` and `replay` read.
"""

from __future__ import annotations

import atexit
import bisect
import json
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_plugin import plugin_logger
from neuron_plugin.inputs import CONTEXT_ENCODING, ForwardInputs

logger = plugin_logger(__name__)

TRACE_ENV = "VLLM_NEURON_TRACE"
TELEMETRY_DIR_ENV = "VLLM_NEURON_TELEMETRY_DIR"
PUBLISH_INTERVAL_S = 0.5
SUMMARY_INTERVAL_S = 300.0
# Histogram upper bounds in seconds: 100 us (host work) to 10 s (a large prefill).
SECONDS_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                  0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COUNTERS = ("calls", "rows", "real_rows", "real_tokens", "padded_tokens",
            "prefix_hit_tokens")


def bucket_label(bucket: tuple[int, ...] | list[int]) -> str:
    return "x".join(str(d) for d in bucket)


@dataclass
class Histogram:
    """Cumulative-ready counts over SECONDS_BOUNDS (+Inf last) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(SECONDS_BOUNDS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(SECONDS_BOUNDS, value)] += 1
        self.total += value

    def merge(self, snapshot: dict[str, Any]) -> None:
        """Add a published histogram ({"counts": [...], "sum": s})."""
        self.counts = [a + b for a, b in zip(self.counts, snapshot["counts"])]
        self.total += snapshot["sum"]


@dataclass
class BucketStats:
    calls: int = 0
    rows: int = 0
    real_rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prefix_hit_tokens: int = 0
    forward: Histogram = field(default_factory=Histogram)
    host: Histogram = field(default_factory=Histogram)


class StepTelemetry:
    """Counters for one engine process (see the module docstring)."""

    def __init__(self, publish_dir: str | Path | None = None):
        self.buckets: dict[tuple[str, tuple[int, ...]], BucketStats] = defaultdict(BucketStats)
        self.step_host = Histogram()
        self._lock = threading.Lock()
        directory = publish_dir or os.environ.get(TELEMETRY_DIR_ENV)
        self._publish_path = Path(directory) / f"engine-{os.getpid()}.json" if directory else None
        self._dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish_loop, daemon=True,
                                        name="neuron-telemetry")
        self._thread.start()

    def record_call(self, inputs: ForwardInputs, forward_s: float, host_s: float) -> None:
        real = inputs.num_real
        with self._lock:
            stats = self.buckets[(inputs.phase, inputs.bucket)]
            stats.calls += 1
            stats.rows += int(inputs.input_ids.shape[0])
            stats.real_rows += real
            stats.real_tokens += inputs.real_tokens
            stats.padded_tokens += inputs.padded_tokens
            if inputs.phase == CONTEXT_ENCODING:
                stats.prefix_hit_tokens += int(inputs.computed_context_lens[:real].sum())
            stats.forward.observe(forward_s)
            stats.host.observe(host_s)
            self._dirty = True

    def record_step_host(self, seconds: float) -> None:
        """Host time of a whole engine step outside backend forwards."""
        with self._lock:
            self.step_host.observe(seconds)
            self._dirty = True

    def _publish_loop(self) -> None:
        """Off the step path: publish when something changed, summarise now and then."""
        last_summary = time.monotonic()
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            if self._dirty and self._publish_path is not None:
                self.publish()
            if time.monotonic() - last_summary >= SUMMARY_INTERVAL_S:
                last_summary = time.monotonic()
                self.log_summary()

    def close(self) -> None:
        """Summary at engine shutdown; the engine's counters leave /metrics with it, as a
        restarted process's counters would."""
        self._stop.set()
        if self._publish_path is not None:
            self._publish_path.unlink(missing_ok=True)
        self.log_summary()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable copy of every counter and histogram."""
        with self._lock:
            rows = []
            for (phase, bucket), s in sorted(self.buckets.items()):
                row = {"phase": phase, "bucket": list(bucket)}
                row.update({name: getattr(s, name) for name in COUNTERS})
                row["forward"] = {"counts": list(s.forward.counts), "sum": s.forward.total}
                row["host"] = {"counts": list(s.host.counts), "sum": s.host.total}
                rows.append(row)
            return {"buckets": rows, "step_host": {"counts": list(self.step_host.counts),
                                                   "sum": self.step_host.total}}

    def publish(self) -> None:
        """Atomically replace this engine's snapshot file."""
        self._dirty = False
        tmp = self._publish_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self._publish_path)

    def summary_lines(self) -> list[str]:
        lines = []
        for row in self.snapshot()["buckets"]:
            total = row["real_tokens"] + row["padded_tokens"]
            waste = row["padded_tokens"] / total if total else 0.0
            lines.append(
                f"{row['phase']:>16} {bucket_label(row['bucket']):>10}: {row['calls']} calls, "
                f"{row['real_tokens']} real / {row['padded_tokens']} padded tokens "
                f"({waste:.0%} padding), forward "
                f"{1000 * row['forward']['sum'] / max(row['calls'], 1):.2f} ms/call")
        return lines

    def log_summary(self) -> None:
        lines = self.summary_lines()
        if lines:
            logger.info("neuron per-bucket summary:\n%s", "\n".join(lines))


class NeuronMetricsCollector:
    """Prometheus collector over the engines' snapshot files (runs in the /metrics process)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def _snapshots(self) -> list[dict[str, Any]]:
        """Snapshots of engines still running (a crashed engine's file is ignored)."""
        found = []
        for path in sorted(self.directory.glob("engine-*.json")):
            if not _alive(int(path.stem.removeprefix("engine-"))):
                continue
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                continue  # replaced mid-read; the next scrape sees it
        return found

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        labels = ["phase", "bucket"]
        counters = {
            "calls": ("neuron:bucket_calls", "Backend calls served by each compiled bucket"),
            "rows": ("neuron:bucket_rows", "Batch rows computed (real plus padding)"),
            "real_rows": ("neuron:bucket_real_rows", "Batch rows holding a real request"),
            "real_tokens": ("neuron:real_tokens", "Tokens that were real work"),
            "padded_tokens": ("neuron:padded_tokens",
                              "Token slots computed for padding (bucket minus real)"),
            "prefix_hit_tokens": ("neuron:prefix_hit_tokens",
                                  "Prompt tokens served from the prefix cache"),
        }
        families = {k: CounterMetricFamily(n, d, labels=labels) for k, (n, d) in counters.items()}
        forward = HistogramMetricFamily("neuron:forward_seconds",
                                        "Backend forward time per call", labels=labels)
        host = HistogramMetricFamily("neuron:host_seconds",
                                     "Host input preparation time per call", labels=labels)
        step = HistogramMetricFamily(
            "neuron:step_host_seconds",
            "Host time of an engine step outside backend forwards (state updates, inputs, "
            "sampling, output)")
        step_total = Histogram()
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        for snap in self._snapshots():
            step_total.merge(snap["step_host"])
            for row in snap["buckets"]:
                key = (row["phase"], bucket_label(row["bucket"]))
                into = merged.setdefault(key, {name: 0 for name in COUNTERS} | {
                    "forward": Histogram(), "host": Histogram()})
                for name in COUNTERS:
                    into[name] += row[name]
                for name in ("forward", "host"):
                    into[name].merge(row[name])
        for key, values in sorted(merged.items()):
            for name, family in families.items():
                family.add_metric(list(key), values[name])
            for hist, family in ((values["forward"], forward), (values["host"], host)):
                family.add_metric(list(key), _cumulative(hist), hist.total)
        step.add_metric([], _cumulative(step_total), step_total.total)
        yield from families.values()
        yield from (forward, host, step)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cumulative(hist: Histogram) -> list[tuple[str, int]]:
    running, out = 0, []
    for bound, count in zip([*map(str, SECONDS_BOUNDS), "+Inf"], hist.counts):
        running += count
        out.append((bound, running))
    return out


_registered = False


def install_metrics_collector() -> Path:
    """In the process that builds the VllmConfig (it serves /metrics): make the snapshot
    directory the engines inherit and register the collector once."""
    global _registered
    directory = os.environ.get(TELEMETRY_DIR_ENV)
    if directory is None:
        directory = tempfile.mkdtemp(prefix="vllm-neuron-telemetry-")
        os.environ[TELEMETRY_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    if not _registered:
        from prometheus_client import REGISTRY

        REGISTRY.register(NeuronMetricsCollector(directory))
        _registered = True
    return Path(directory)


class RequestTrace:
    """Opt-in JSONL trace of request shapes for `neuron-buckets tune/replay`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> RequestTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")
