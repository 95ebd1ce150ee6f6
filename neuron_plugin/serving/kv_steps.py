"""vLLM's KV-connector calls around one engine step, made as vLLM's own GPU model runner
makes them (`vllm/v1/worker/gpu/kv_connector.py` `ActiveKVConnector`, vLLM 0.32), for
the Neuron model runner:

- `begin`, in `execute_model` once the previous step is complete (no backend call in
  flight, so loads may write into the backend's cache) and before this step's calls:
  `handle_preemptions`, `bind_connector_metadata`, `start_load_kv` (under a forward
  context without attention metadata, as vLLM's no-forward steps have);
- `finish`, once the step's backend calls are complete (with async scheduling when the
  step completes, so saves read what the calls wrote): `wait_for_save`,
  `get_transfer_results`, the load errors, stats, events and worker metadata,
  `clear_connector_metadata`; its `KVConnectorOutput` goes on the step's output.

Every step makes both calls, steps without scheduled tokens too: a decode request's load
is done in such a step, and `finished_recving` travels on its output.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput


class KVTransferSteps:
    """See the module docstring."""

    def __init__(self, connector: KVConnectorBase_V1, vllm_config: VllmConfig):
        self.connector = connector
        self.vllm_config = vllm_config

    def begin(self, so: SchedulerOutput) -> None:
        meta = so.kv_connector_metadata
        if meta is None:
            raise RuntimeError(
                "vLLM scheduled a step without KV connector metadata while a connector is "
                "configured: its scheduler has no connector; report this with the log"
            )
        self.connector.handle_preemptions(meta)
        self.connector.bind_connector_metadata(meta)
        with set_forward_context(None, self.vllm_config):
            self.connector.start_load_kv(get_forward_context())

    def finish(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        connector = self.connector
        connector.wait_for_save()
        results = connector.get_transfer_results(finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_stats=connector.get_kv_connector_stats(),
            kv_cache_events=connector.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return output
