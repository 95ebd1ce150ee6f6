"""Per-bucket telemetry: which graph served each backend call, how much was padding, and
where the time went (backend forward vs host work around it).

Always on and cheap: a call adds to a handful of counters keyed by (phase, bucket). The
counters are exported as Prometheus metrics, summarised in the log periodically and at
shutdown, and, when `VLLM_NEURON_TRACE` names a file, every request's shape is appended
to it as JSONL that `neuron-buckets tune` and `replay` read directly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_plugin.inputs import ForwardInputs
from neuron_plugin import plugin_logger

logger = plugin_logger(__name__)

TRACE_ENV = "VLLM_NEURON_TRACE"
SUMMARY_INTERVAL_ENV = "VLLM_NEURON_TELEMETRY_INTERVAL_S"


def bucket_label(bucket: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in bucket)


@dataclass
class BucketStats:
    calls: int = 0
    real_rows: int = 0
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prefix_hit_tokens: int = 0
    forward_s: float = 0.0
    host_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StepTelemetry:
    """Counters for one engine process (see the module docstring)."""

    summary_interval_s: float = 60.0
    buckets: dict[tuple[str, tuple[int, ...]], BucketStats] = field(
        default_factory=lambda: defaultdict(BucketStats))
    step_host_s: float = 0.0
    steps: int = 0
    _last_summary: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_call(self, inputs: ForwardInputs, forward_s: float, host_s: float) -> None:
        real = inputs.num_real
        with self._lock:
            stats = self.buckets[(inputs.phase, inputs.bucket)]
            stats.calls += 1
            stats.real_rows += real
            stats.rows += int(inputs.input_ids.shape[0])
            stats.real_tokens += inputs.real_tokens
            stats.padded_tokens += inputs.padded_tokens
            if inputs.phase == "context_encoding":
                stats.prefix_hit_tokens += int(inputs.computed_context_lens[:real].sum())
            stats.forward_s += forward_s
            stats.host_s += host_s

    def record_step_host(self, seconds: float) -> None:
        with self._lock:
            self.step_host_s += seconds
            self.steps += 1
        if time.monotonic() - self._last_summary >= self.summary_interval_s:
            self.log_summary()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable copy of every counter."""
        with self._lock:
            return {
                "steps": self.steps,
                "step_host_s": self.step_host_s,
                "buckets": [
                    {"phase": phase, "bucket": list(bucket), **stats.as_dict()}
                    for (phase, bucket), stats in sorted(self.buckets.items())
                ],
            }

    def summary_lines(self) -> list[str]:
        lines = []
        for row in self.snapshot()["buckets"]:
            total = row["real_tokens"] + row["padded_tokens"]
            waste = row["padded_tokens"] / total if total else 0.0
            lines.append(
                f"{row['phase']:>16} {bucket_label(tuple(row['bucket'])):>10}: "
                f"{row['calls']} calls, {row['real_tokens']} real / {row['padded_tokens']} "
                f"padded tokens ({waste:.0%} padding), forward "
                f"{1000 * row['forward_s'] / max(row['calls'], 1):.2f} ms/call"
            )
        return lines

    def log_summary(self) -> None:
        self._last_summary = time.monotonic()
        lines = self.summary_lines()
        if lines:
            logger.info("neuron per-bucket summary:\n%s", "\n".join(lines))


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
