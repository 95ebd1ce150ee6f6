"""One engine step's data from `execute_model` to its completion, and the promise vLLM's
async scheduling contract hands the engine for it (see `serving.model_runner`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, KVConnectorOutput, ModelRunnerOutput

from neuron_plugin.core.inputs import ForwardInputs
from neuron_plugin.core.sampling import SamplingInputs


@dataclass
class BackendCall:
    """A backend call submitted and not yet collected (async scheduling)."""

    inputs: ForwardInputs
    rows: np.ndarray  # the batch rows it computes
    sampling: SamplingInputs
    host_s: float  # preparing its inputs
    submit_s: float  # the submit itself


@dataclass
class PendingStep:
    """One step from execute_model to its completion (rows: batch order)."""

    scheduler_output: SchedulerOutput
    samples: np.ndarray  # bool: does this row produce a token now
    host: np.ndarray  # bool: vLLM's Sampler samples this row from `logits`
    host_pos: np.ndarray  # int64: a host row's row in the host batch (-1: device row)
    logits: torch.Tensor  # [host batch rows, vocab] float32, in the host batch's order
    sampling: SamplingInputs | None  # with on-device sampling
    tokens: np.ndarray  # int32: the device's token (unused without on-device sampling)
    grammar_output: GrammarOutput | None = None
    in_flight: BackendCall | None = None
    active_s: float = 0.0  # this runner's time on the step
    backend_s: float = 0.0  # of which waiting for backend calls
    output: ModelRunnerOutput | None = None  # once complete
    failed: dict[str, str] = field(default_factory=dict)  # requests the step failed: why
    # requests whose prompt logprobs are complete once the step's calls are
    prompt_done: list[str] = field(default_factory=list)


class AsyncStepOutput(AsyncModelRunnerOutput):
    """A step's output under async scheduling: `get_output` blocks until the step is
    complete. vLLM 0.33 also asks a failed step for the KV-connector output it got
    (`get_kv_connector_output`, abstract there; `WorkerProc` in
    `v1/executor/multiproc_executor.py` calls it when `get_output` raises)."""

    def __init__(self, complete: Callable[[PendingStep], ModelRunnerOutput], step: PendingStep):
        self._complete = complete
        self._step = step

    def get_output(self) -> ModelRunnerOutput:
        return self._complete(self._step)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        """What the step's KV connector reported, if the step got that far."""
        output = self._step.output
        return None if output is None else output.kv_connector_output
