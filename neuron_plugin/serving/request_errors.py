"""Ending one request with an error from inside an engine step, the engine serving on.

vLLM 0.32's model-runner contract has no way to fail one request: a `ModelRunnerOutput`
carries tokens, logprobs and connector outputs, and its scheduler ends a request with
an error only for a KV load that failed (`KVConnectorOutput.failed_recving` /
`invalid_block_ids` under kv_load_failure_policy fail, for requests waiting for remote
KV), a grammar that failed to compile or rejected tokens, or an encoder-cache miss
(`Scheduler.update_from_output`); anything a model runner raises ends the engine. The
Neuron step meets such a request where it writes a LoRA adapter into a slot and cannot
(`serving.adapters`: an offline request's adapter read for the first time and refused,
a backend refusing the write).

So with LoRA on the platform runs vLLM's own scheduler (`Scheduler`, or `AsyncScheduler`
with async scheduling) with one addition: the model runner lists such requests, with
the reason, in `RunnerOutput.failed_requests`, emitting no token for them; after vLLM's
own `update_from_output` they end as vLLM ends a request whose KV load failed
(`finish_requests(..., FINISHED_ERROR)`, an EngineCoreOutput with finish reason
"error": vLLM's API server answers it with its HTTP 500, the reason in the server log),
and their blocks leave the prefix cache (nothing was computed into them). With another
scheduler class chosen by the user (--scheduler-cls) there is no such channel: the
model runner then raises, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from neuron_plugin import plugin_logger

logger = plugin_logger(__name__)

SCHEDULER = f"{__name__}.NeuronScheduler"
ASYNC_SCHEDULER = f"{__name__}.NeuronAsyncScheduler"


@dataclass
class RunnerOutput(ModelRunnerOutput):
    """A step's output with the requests it failed: request id -> reason."""

    failed_requests: dict[str, str] = field(default_factory=dict)


class EndsFailedRequests:
    """The addition to vLLM's scheduler (module docstring)."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        failed = getattr(model_runner_output, "failed_requests", None) or {}
        blocks = {
            rid: self.kv_cache_manager.get_block_ids(rid)[0]  # type: ignore[attr-defined]
            for rid in failed
            if rid in self.requests  # type: ignore[attr-defined]
        }
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        if not blocks:
            return outputs
        for request in self.finish_requests(  # type: ignore[attr-defined]
            blocks, RequestStatus.FINISHED_ERROR
        ):
            logger.error("request %s failed: %s", request.request_id, failed[request.request_id])
            eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    stop_reason=failed[request.request_id],
                )
            )
        self.kv_cache_manager.evict_blocks(  # type: ignore[attr-defined]
            {block for ids in blocks.values() for block in ids}
        )
        return outputs


class NeuronScheduler(EndsFailedRequests, Scheduler):
    """vLLM's Scheduler that ends the requests a step failed."""


class NeuronAsyncScheduler(EndsFailedRequests, AsyncScheduler):
    """vLLM's AsyncScheduler that ends the requests a step failed."""


def scheduler_class(async_scheduling: bool) -> str:
    return ASYNC_SCHEDULER if async_scheduling else SCHEDULER


def can_fail_requests(vllm_config: Any) -> bool:
    """Whether this engine's scheduler ends the requests a step fails."""
    return vllm_config.scheduler_config.scheduler_cls in (SCHEDULER, ASYNC_SCHEDULER)
