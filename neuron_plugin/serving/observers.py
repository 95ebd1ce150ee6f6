"""What the model runner reports, and to whom: observers of backend calls, engine steps
and finished requests. The runner knows nothing of metrics or traces; the worker decides
which observers to install (`serving.telemetry.StepTelemetry`, `RequestTrace`)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from neuron_plugin.core.inputs import ForwardInputs

TRACE_ENV = "VLLM_NEURON_TRACE"


@dataclass(frozen=True)
class FinishedRequest:
    """A finished request's shape, in the fields `neuron-buckets tune/replay` read."""

    prompt_tokens: int
    output_tokens: int
    prefix_hit_tokens: int
    bucket: list[int]
    ttft_ms: float
    duration_ms: float
    # The requests decoding beside it, itself included: the mean rows of its decode
    # steps (1 when it never decoded), what `neuron-buckets tune --pair batch` learns
    # decode batch buckets from.
    batch: int = 1


class StepObserver(Protocol):
    def on_backend_call(
        self, inputs: ForwardInputs, forward_s: float, host_s: float, accepted: int = 0
    ) -> None:
        """One backend call: its inputs, forward time, host preparation time and, with
        speculative decoding, how many of its drafts (`inputs.draft_budget`) the device
        rows accepted."""

    def on_vision_call(self, bucket: int, patches: int, forward_s: float) -> None:
        """One image through the vision encoder's graph of `bucket` patches."""

    def on_step(self, host_s: float) -> None:
        """One engine step's host time outside backend forwards."""

    def on_request_finished(self, request: FinishedRequest) -> None:
        """A request left the engine (finished or aborted)."""


class RequestTrace:
    """Opt-in (`VLLM_NEURON_TRACE=FILE`) JSONL trace of finished requests' shapes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> RequestTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def on_backend_call(
        self, inputs: ForwardInputs, forward_s: float, host_s: float, accepted: int = 0
    ) -> None:
        pass

    def on_vision_call(self, bucket: int, patches: int, forward_s: float) -> None:
        pass

    def on_step(self, host_s: float) -> None:
        pass

    def on_request_finished(self, request: FinishedRequest) -> None:
        line = json.dumps(asdict(request), sort_keys=True)
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")
