"""Per-bucket telemetry: which graph served each backend call, how much was padding, and
where the time went (backend forward vs host work around it).

Always on and cheap: a call adds to a few counters keyed by (phase, bucket). Every series
is labelled with `model_name` and `engine` (the data-parallel rank), as vLLM labels its
own; `sum by (phase, bucket)` gives the server's total. Engines export off the step path
(at most every PUBLISH_INTERVAL_S), the way vLLM exposes metrics in the mode it runs:

- one API server (vLLM's default without data parallelism): each engine writes a small
  JSON snapshot into a directory named in `additional_config` (see
  `serving.vllm_settings.apply`); in the process that serves `/metrics`, vLLM builds
  `NeuronStatLogger` (entry point `vllm.stat_logger_plugins`), which registers a
  collector on Prometheus's default registry reading the snapshots at scrape time;
- several API servers (`--api-server-count` > 1, vLLM's default under
  `--data-parallel-size`): vLLM sets PROMETHEUS_MULTIPROC_DIR before it starts the
  engines and serves `/metrics` from prometheus_client's MultiProcessCollector, which
  sees no collector on the default registry. Each engine then records into
  prometheus_client metrics of its own, which that mode writes into the shared directory,
  so every API server's `/metrics` shows every engine once.

Nothing registers in a process that serves no `/metrics` (explain-config, precompile,
offline `LLM`). A compact per-bucket summary is logged periodically and at shutdown.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import functools
import json
import os
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from vllm.v1.metrics.loggers import StatLoggerBase

from neuron_plugin import plugin_logger
from neuron_plugin.core.inputs import CONTEXT_ENCODING, ForwardInputs
from neuron_plugin.core.vision import VISION_ENCODING
from neuron_plugin.serving.observers import FinishedRequest
from neuron_plugin.serving.vllm_settings import SETTINGS_KEY, TELEMETRY_DIR_KEY

logger = plugin_logger(__name__)

PUBLISH_INTERVAL_S = 0.5
SUMMARY_INTERVAL_S = 300.0
# Histogram upper bounds in seconds: 100 us (host work) to 10 s (a large prefill).
SECONDS_BOUNDS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
ENGINE_LABELS = ("model_name", "engine")
BUCKET_LABELS = (*ENGINE_LABELS, "phase", "bucket")
# Snapshot field -> (Prometheus name, help); the order is that of `Call.counts`.
COUNTER_FAMILIES = {
    "calls": ("neuron:bucket_calls", "Backend calls served by each compiled bucket"),
    "rows": ("neuron:bucket_rows", "Batch rows computed (real plus padding)"),
    "real_rows": ("neuron:bucket_real_rows", "Batch rows holding a real request"),
    "real_tokens": ("neuron:real_tokens", "Tokens that were real work"),
    "padded_tokens": (
        "neuron:padded_tokens",
        "Token slots computed for padding (bucket minus real)",
    ),
    "prefix_hit_tokens": ("neuron:prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
    "draft_tokens": (
        "neuron:spec_draft_tokens",
        "Draft tokens verified (speculative decoding; vLLM's vllm:spec_decode_* count per request)",
    ),
    "accepted_tokens": ("neuron:spec_accepted_tokens", "Draft tokens accepted"),
}
COUNTERS = tuple(COUNTER_FAMILIES)
HISTOGRAM_FAMILIES = {
    "forward": ("neuron:forward_seconds", "Backend forward time per call"),
    "host": ("neuron:host_seconds", "Host input preparation time per call"),
}
STEP_HOST_FAMILY = (
    "neuron:step_host_seconds",
    "Host time of an engine step outside backend forwards (state updates, inputs, "
    "sampling, output)",
)
# Engine totals, counted once per event rather than per call: snapshot field ->
# (Prometheus name, help, the label that splits it).
TOTAL_FAMILIES = {
    "compile_cache_lookups": (
        "neuron:compile_cache_lookups",
        "Compile-cache lookups at engine start: hit (compiled graphs loaded) or miss "
        "(compiled, then published)",
        "result",
    ),
    "kv_transfer_bytes": (
        "neuron:kv_transfer_bytes",
        "KV-cache bytes moved through payloads (prefill/decode disaggregation): saved by "
        "a prefill, loaded by a decode",
        "direction",
    ),
}
TOTALS = tuple(TOTAL_FAMILIES)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """True where vLLM serves /metrics from prometheus_client's multiprocess directory
    (several API servers); engines inherit the variable from the process starting them."""
    return MULTIPROC_ENV in os.environ


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
        self.counts = [a + b for a, b in zip(self.counts, snapshot["counts"], strict=True)]
        self.total += snapshot["sum"]


class Call(NamedTuple):
    """One backend call as the counters see it."""

    phase: str
    bucket: tuple[int, ...]
    counts: tuple[int, ...]  # one per COUNTERS entry
    forward_s: float
    host_s: float


@dataclass
class BucketStats:
    calls: int = 0
    rows: int = 0
    real_rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forward: Histogram = field(default_factory=Histogram)
    host: Histogram = field(default_factory=Histogram)

    def add(self, call: Call) -> None:
        for name, count in zip(COUNTERS, call.counts, strict=True):
            setattr(self, name, getattr(self, name) + count)
        self.forward.observe(call.forward_s)
        self.host.observe(call.host_s)


class StepTelemetry:
    """Counters for one engine process, a `StepObserver` (see the module docstring)."""

    def __init__(
        self, publish_dir: str | Path | None = None, *, model_name: str = "", engine: int = 0
    ):
        self.labels = {"model_name": model_name, "engine": str(engine)}
        self.buckets: dict[tuple[str, tuple[int, ...]], BucketStats] = defaultdict(BucketStats)
        self.step_host = Histogram()
        # name -> label value -> total, and what reports totals kept elsewhere
        self.totals: dict[str, dict[str, float]] = {name: {} for name in TOTALS}
        self._sources: list[Callable[[], Mapping[str, Mapping[str, float]]]] = []
        self._lock = threading.Lock()
        # Several API servers: calls and steps not yet recorded into prometheus_client.
        self._native = _native_metrics() if multiprocess_mode() else None
        self._pending_calls: list[Call] = []
        self._pending_steps: list[float] = []
        self._publish_path = (
            Path(publish_dir) / f"engine-{os.getpid()}.json"
            if publish_dir and self._native is None
            else None
        )
        self._dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._publish_loop, daemon=True, name="neuron-telemetry"
        )
        self._thread.start()

    def on_backend_call(
        self, inputs: ForwardInputs, forward_s: float, host_s: float, accepted: int = 0
    ) -> None:
        real = inputs.num_real
        prefix_hits = (
            int(inputs.computed_context_lens[:real].sum())
            if inputs.phase == CONTEXT_ENCODING
            else 0
        )
        call = Call(
            inputs.phase,
            inputs.bucket,
            (
                1,
                int(inputs.input_ids.shape[0]),
                real,
                inputs.real_tokens,
                inputs.padded_tokens,
                prefix_hits,
                int(inputs.draft_budget[:real].sum()),
                accepted,
            ),
            forward_s,
            host_s,
        )
        self._record(call)

    def on_vision_call(self, bucket: int, patches: int, forward_s: float) -> None:
        """One image through the vision graph of `bucket` patches: a row, its patches
        the real tokens and the rest of the bucket padding."""
        counts = (1, 1, 1, patches, bucket - patches, 0, 0, 0)
        self._record(Call(VISION_ENCODING, (bucket,), counts, forward_s, 0.0))

    def _record(self, call: Call) -> None:
        with self._lock:
            self.buckets[(call.phase, call.bucket)].add(call)
            if self._native is not None:
                self._pending_calls.append(call)
            self._dirty = True

    def on_step(self, host_s: float) -> None:
        """Host time of a whole engine step outside backend forwards."""
        with self._lock:
            self.step_host.observe(host_s)
            if self._native is not None:
                self._pending_steps.append(host_s)
            self._dirty = True

    def on_request_finished(self, request: FinishedRequest) -> None:
        pass

    def count(self, name: str, label: str, amount: float = 1) -> None:
        """Add to an engine total (TOTAL_FAMILIES)."""
        with self._lock:
            self.totals[name][label] = self.totals[name].get(label, 0) + amount
            self._dirty = True

    def watch(self, source: Callable[[], Mapping[str, Mapping[str, float]]]) -> None:
        """Totals another object keeps (name -> label value -> total since start, e.g.
        the KV connector's bytes), read at each publish."""
        with self._lock:
            self._sources.append(source)
            self._dirty = True

    def _read_sources(self) -> None:
        for source in self._sources:
            for name, values in source().items():
                if dict(values) != self.totals[name]:
                    self.totals[name] = dict(values)
                    self._dirty = True

    def _publish_loop(self) -> None:
        """Off the step path: publish when something changed, summarise now and then."""
        last_summary = time.monotonic()
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            with self._lock:
                self._read_sources()
            if self._dirty:
                self.publish()
            if time.monotonic() - last_summary >= SUMMARY_INTERVAL_S:
                last_summary = time.monotonic()
                self.log_summary()

    def close(self) -> None:
        """Summary at engine shutdown. A snapshot leaves /metrics with its engine, as a
        restarted process's counters would; prometheus_client's multiprocess mode keeps
        a finished process's counters, so the last calls are recorded first."""
        self._stop.set()
        self._thread.join()
        if self._native is not None:
            self.publish()
        if self._publish_path is not None:
            self._publish_path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the last engine out; else not empty
                self._publish_path.parent.rmdir()
        self.log_summary()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable copy of every counter and histogram, with the labels."""
        with self._lock:
            rows = []
            for (phase, bucket), s in sorted(self.buckets.items()):
                row: dict[str, Any] = {"phase": phase, "bucket": list(bucket)}
                row.update({name: getattr(s, name) for name in COUNTERS})
                row["forward"] = {"counts": list(s.forward.counts), "sum": s.forward.total}
                row["host"] = {"counts": list(s.host.counts), "sum": s.host.total}
                rows.append(row)
            return {
                "labels": dict(self.labels),
                "buckets": rows,
                "step_host": {"counts": list(self.step_host.counts), "sum": self.step_host.total},
                "totals": {name: dict(values) for name, values in self.totals.items()},
            }

    def publish(self) -> None:
        """Hand what changed to the exporter of the serving mode (module docstring):
        record pending calls into prometheus_client, or atomically replace this engine's
        snapshot file."""
        if self._native is not None:
            with self._lock:
                calls, steps = self._pending_calls, self._pending_steps
                self._pending_calls, self._pending_steps = [], []
                totals = {name: dict(values) for name, values in self.totals.items()}
                self._dirty = False
            self._native.record(self.labels, calls, steps, totals)
            return
        self._dirty = False
        if self._publish_path is None:
            return
        self._publish_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self._publish_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self._publish_path)

    def summary_lines(self) -> list[str]:
        lines = []
        for row in self.snapshot()["buckets"]:
            total = row["real_tokens"] + row["padded_tokens"]
            waste = row["padded_tokens"] / total if total else 0.0
            drafts = row["draft_tokens"]
            speculation = (
                f", {row['accepted_tokens']}/{drafts} drafts accepted "
                f"({row['accepted_tokens'] / drafts:.0%}, "
                f"{1 + row['accepted_tokens'] / max(row['real_rows'], 1):.2f} tokens a row "
                f"per call)"
                if drafts
                else ""
            )
            lines.append(
                f"{row['phase']:>16} {bucket_label(row['bucket']):>10}: {row['calls']} calls, "
                f"{row['real_tokens']} real / {row['padded_tokens']} padded tokens "
                f"({waste:.0%} padding){speculation}, forward "
                f"{1000 * row['forward']['sum'] / max(row['calls'], 1):.2f} ms/call"
            )
        return lines

    def log_summary(self) -> None:
        lines = self.summary_lines()
        if lines:
            logger.info("neuron per-bucket summary:\n%s", "\n".join(lines))


class _NativeMetrics:
    """The same families as prometheus_client metrics, for the multiprocess mode: their
    values go to this process's files in PROMETHEUS_MULTIPROC_DIR, which every API
    server's MultiProcessCollector reads and sums per label set."""

    def __init__(self) -> None:
        from prometheus_client import Counter
        from prometheus_client import Histogram as PromHistogram

        self.counters = [
            Counter(name, doc, BUCKET_LABELS, registry=None)
            for name, doc in COUNTER_FAMILIES.values()
        ]
        self.forward, self.host = (
            PromHistogram(name, doc, BUCKET_LABELS, buckets=SECONDS_BOUNDS, registry=None)
            for name, doc in HISTOGRAM_FAMILIES.values()
        )
        self.step = PromHistogram(
            *STEP_HOST_FAMILY, ENGINE_LABELS, buckets=SECONDS_BOUNDS, registry=None
        )
        self.totals = {
            key: Counter(name, doc, (*ENGINE_LABELS, label), registry=None)
            for key, (name, doc, label) in TOTAL_FAMILIES.items()
        }
        self._recorded: dict[tuple[str, str], float] = {}

    def record(
        self,
        labels: dict[str, str],
        calls: list[Call],
        steps: list[float],
        totals: Mapping[str, Mapping[str, float]],
    ) -> None:
        for call in calls:
            series = {**labels, "phase": call.phase, "bucket": bucket_label(call.bucket)}
            for counter, count in zip(self.counters, call.counts, strict=True):
                counter.labels(**series).inc(count)
            self.forward.labels(**series).observe(call.forward_s)
            self.host.labels(**series).observe(call.host_s)
        step = self.step.labels(**labels)
        for host_s in steps:
            step.observe(host_s)
        for key, values in totals.items():
            label = TOTAL_FAMILIES[key][2]
            for value, total in values.items():
                grown = total - self._recorded.get((key, value), 0)
                if grown > 0:
                    self.totals[key].labels(**labels, **{label: value}).inc(grown)
                    self._recorded[(key, value)] = total


@functools.cache
def _native_metrics() -> _NativeMetrics:
    """One set per process: two objects for one series would overwrite each other's
    value in the shared file. prometheus_client picks its value class once, at import:
    an engine forked (VLLM_WORKER_MULTIPROC_METHOD=fork) from a `vllm serve` that had
    imported it before vLLM set PROMETHEUS_MULTIPROC_DIR inherits the single-process
    one, whose values would stay in this process's memory, unseen by every /metrics."""
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.get_value_class()
    return _NativeMetrics()


class NeuronMetricsCollector:
    """Prometheus collector over the engines' snapshot files (runs in the /metrics
    process), in every telemetry directory it is given: each configuration started in
    the process has its own."""

    def __init__(self, *directories: str | Path):
        self.directories = [Path(d) for d in directories]

    def _snapshots(self) -> list[dict[str, Any]]:
        """Snapshots of engines still running (a crashed engine's file is ignored)."""
        found = []
        paths = (p for d in self.directories for p in sorted(d.glob("engine-*.json")))
        for path in paths:
            if not _alive(int(path.stem.removeprefix("engine-"))):
                continue
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                continue  # replaced mid-read; the next scrape sees it
        return found

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        families = {
            key: CounterMetricFamily(name, doc, labels=BUCKET_LABELS)
            for key, (name, doc) in COUNTER_FAMILIES.items()
        }
        histograms = {
            key: HistogramMetricFamily(name, doc, labels=BUCKET_LABELS)
            for key, (name, doc) in HISTOGRAM_FAMILIES.items()
        }
        step = HistogramMetricFamily(*STEP_HOST_FAMILY, labels=ENGINE_LABELS)
        totals = {
            key: CounterMetricFamily(name, doc, labels=[*ENGINE_LABELS, label])
            for key, (name, doc, label) in TOTAL_FAMILIES.items()
        }
        steps: dict[tuple[str, ...], Histogram] = defaultdict(Histogram)
        summed: dict[str, dict[tuple[str, ...], float]] = {
            key: defaultdict(float) for key in TOTALS
        }
        merged: dict[tuple[str, ...], dict[str, Any]] = {}
        for snap in self._snapshots():
            engine = tuple(snap["labels"][name] for name in ENGINE_LABELS)
            steps[engine].merge(snap["step_host"])
            for key, values in snap.get("totals", {}).items():
                for value, total in values.items():
                    summed[key][(*engine, value)] += total
            for row in snap["buckets"]:
                key = (*engine, row["phase"], bucket_label(row["bucket"]))
                into = merged.setdefault(
                    key,
                    dict.fromkeys(COUNTERS, 0) | {name: Histogram() for name in HISTOGRAM_FAMILIES},
                )
                for name in COUNTERS:
                    into[name] += row[name]
                for name in HISTOGRAM_FAMILIES:
                    into[name].merge(row[name])
        for key, values in sorted(merged.items()):
            for name, family in families.items():
                family.add_metric(list(key), values[name])
            for name, histogram in histograms.items():
                histogram.add_metric(list(key), _cumulative(values[name]), values[name].total)
        for engine, hist in sorted(steps.items()):
            step.add_metric(list(engine), _cumulative(hist), hist.total)
        for key, series in summed.items():
            for labels, total in sorted(series.items()):
                totals[key].add_metric(list(labels), total)
        yield from families.values()
        yield from histograms.values()
        yield step
        yield from totals.values()


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
    for bound, count in zip([*map(str, SECONDS_BOUNDS), "+Inf"], hist.counts, strict=True):
        running += count
        out.append((bound, running))
    return out


@functools.cache
def _process_collector() -> NeuronMetricsCollector:
    """The process's one collector on Prometheus's default registry: a second one would
    expose the same series names, which prometheus_client refuses (an offline user who
    starts one `LLM` after another in a process registers each configuration)."""
    from prometheus_client import REGISTRY

    collector = NeuronMetricsCollector()
    REGISTRY.register(collector)
    return collector


def register_collector(vllm_config: Any) -> Path | None:
    """Expose this configuration's engine counters on Prometheus's default registry
    (its telemetry directory joins the process's collector); None when the Neuron
    platform did not resolve it, or in the multiprocess mode, where the engines export
    themselves (module docstring). Serving frontends get it from `NeuronStatLogger`; an
    offline `LLM` user calls it."""
    additional = vllm_config.additional_config or {}
    directory = additional.get(TELEMETRY_DIR_KEY)
    if SETTINGS_KEY not in additional or not directory or multiprocess_mode():
        return None
    collector = _process_collector()
    if Path(directory) not in collector.directories:
        collector.directories.append(Path(directory))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return Path(directory)


class NeuronStatLogger(StatLoggerBase):
    """vLLM stat-logger plugin (entry point `vllm.stat_logger_plugins`): vLLM builds it
    only in a serving frontend, the process that exposes `/metrics`, which is the one
    place the Neuron collector belongs."""

    def __init__(self, vllm_config: Any, engine_index: int = 0):
        register_collector(vllm_config)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """vLLM's per-step stats; the Neuron counters come from the engines' snapshots."""

    def log_engine_initialized(self) -> None:
        """Nothing to add to vLLM's start-up log."""
