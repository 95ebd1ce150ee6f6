"""The vLLM worker for Neuron: opens the backend (in this process, or in a runner process
in the backend's own Python environment) through the compile cache, installs the
telemetry and trace observers, and hands each engine step to `NeuronModelRunner`.

Each engine sees only its own NeuronCores: data-parallel engine r on this host takes the
r-th run of `tensor_parallel_size` visible cores (`NeuronSettings.rank_cores`, decided
with the rest of the settings), set before the backend or its runner process (which
inherits the environment) starts.

The backend owns its KV cache (NxDI allocates it inside the compiled model), so the
worker reports a KV spec and a block count to vLLM's scheduler but allocates nothing for
vLLM; it checks that the block count vLLM settled on is the one the graphs were built for.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import torch
from vllm.config import VllmConfig
from vllm.config.model import get_served_model_name
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import LoadedBackend
from neuron_plugin.backends.loader import open_backend
from neuron_plugin.core.checkpoint import safetensors_shapes
from neuron_plugin.core.instances import VISIBLE_CORES_ENV, format_core_list
from neuron_plugin.core.lifecycle import die_with_parent
from neuron_plugin.core.lora import LoraGeometry, lora_summary
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.threads import (
    ENGINE,
    apply_serving_threads,
    available_cores,
    model_on_host,
    serving_threads,
)
from neuron_plugin.serving.adapters import AdapterStore
from neuron_plugin.serving.kv_steps import KVTransferSteps
from neuron_plugin.serving.model_runner import NeuronModelRunner
from neuron_plugin.serving.observers import RequestTrace, StepObserver
from neuron_plugin.serving.telemetry import StepTelemetry
from neuron_plugin.serving.vllm_settings import TELEMETRY_DIR_KEY, settings_from_vllm_config

logger = plugin_logger(__name__)


class NeuronWorker(WorkerBase):
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        # vLLM 0.32's engine process outlives an API server killed with SIGKILL, and with
        # it the backend and its NeuronCores: end it the way vLLM's own SIGTERM does.
        # Only in a process vLLM started (never a server running its engine in-process).
        parent = multiprocessing.parent_process()
        if parent is not None:
            die_with_parent(signal.SIGTERM, parent.pid)
        self.settings: NeuronSettings = settings_from_vllm_config(vllm_config)
        parallel = vllm_config.parallel_config
        # vLLM runs dense data-parallel ranks as independent engines; these two survive.
        engine, local_rank = parallel.data_parallel_index, parallel.data_parallel_rank_local or 0
        if self.settings.rank_cores:
            cores = format_core_list(self.settings.rank_cores[local_rank])
            os.environ[VISIBLE_CORES_ENV] = cores
            logger.info(
                "engine %d (data-parallel rank %d on this host): %s=%s",
                engine,
                local_rank,
                VISIBLE_CORES_ENV,
                cores,
            )
        extra = vllm_config.additional_config
        self.telemetry = StepTelemetry(
            extra.get(TELEMETRY_DIR_KEY) if isinstance(extra, dict) else None,
            model_name=get_served_model_name(
                vllm_config.model_config.model, vllm_config.model_config.served_model_name
            ),
            engine=engine,
        )
        trace = RequestTrace.from_env()
        self.observers: list[StepObserver] = [self.telemetry, *([trace] if trace else [])]
        self.backend: LoadedBackend | None = None
        # vLLM's WorkerBase types this nn.Module, which no model runner is (vLLM's own
        # workers override it the same way).
        self.model_runner: NeuronModelRunner | None = None  # type: ignore[assignment]
        self.load_seconds = 0.0
        self.torch_threads = 0  # for serving, set once loaded (core.threads)
        self.adapters: AdapterStore | None = None

    def init_device(self) -> None:
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        self.device = torch.device("cpu")
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
        )

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        started = time.perf_counter()
        self.backend = open_backend(
            self.settings,
            self.model_config.model,
            looked_up=lambda result: self.telemetry.count(
                "compile_cache_lookups", "hit" if result.hit else "miss"
            ),
        )
        async_scheduling = bool(self.vllm_config.scheduler_config.async_scheduling)
        self.adapters = self._adapter_store(self.backend)
        self.model_runner = NeuronModelRunner(
            self.vllm_config,
            self.settings,
            self.backend,
            self.observers,
            async_scheduling,
            self.adapters,
        )
        if not async_scheduling:
            logger.info("async scheduling off: each step completes before the next starts")
        elif self.settings.backend_python:
            logger.info(
                "async scheduling on: the engine schedules step N+1 while the backend "
                "runner process computes step N"
            )
        else:
            logger.info(
                "async scheduling on, with the backend in this process: its forward "
                "does not overlap the engine's host work (a runner process's does)"
            )
        self.load_seconds = time.perf_counter() - started
        # serving's thread count once loaded (loading keeps torch's own): core.threads
        settings = self.settings
        self.torch_threads = apply_serving_threads(
            ENGINE,
            serving_threads(
                ENGINE,
                cores=available_cores(),
                engines=settings.dp_degree,
                model_on_host=model_on_host(settings.backend, settings.passthrough),
                runner=bool(settings.backend_python),
            ),
            logger,
        )

    def _adapter_store(self, backend: LoadedBackend) -> AdapterStore | None:
        """The worker's LoRA adapters (None without --enable-lora)."""
        settings = self.settings
        if not settings.max_loras:
            return None
        text = self.model_config.hf_text_config
        shapes = safetensors_shapes(self.model_config.model)
        geometry = LoraGeometry.from_checkpoint(
            shapes, text.num_hidden_layers, settings.lora_target_modules
        )
        logger.info("%s", lora_summary(settings))
        return AdapterStore(
            settings,
            geometry,
            backend,
            self.vllm_config.lora_config,
            getattr(text, "max_position_embeddings", None),
            frozenset(name.rsplit(".", 1)[0] for name in shapes),
        )

    def _store(self) -> AdapterStore:
        adapters = self.adapters
        if adapters is None:
            raise ValueError(
                "LoRA is not enabled on this engine; start it with --enable-lora "
                "(and --max-loras / --max-lora-rank) to load adapters."
            )
        return adapters

    # vLLM's LoRA worker API (the executor calls these from add_lora / remove_lora /
    # pin_lora / list_loras of the engine; see serving.adapters).
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._store().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._store().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._store().pin(lora_id)

    def list_loras(self) -> set[int]:
        return self._store().ids()

    def _runner(self) -> NeuronModelRunner:
        if self.model_runner is None:
            raise RuntimeError(
                "the Neuron worker has no model yet: vLLM calls load_model "
                "before anything that needs one"
            )
        return self.model_runner

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self._runner().get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return [KVCacheLayout.LBNHC.name]

    def determine_available_memory(self) -> int:
        """Exactly the settings' block count: the platform pins it with
        num_gpu_blocks_override, so vLLM and the compiled graphs agree."""
        return self.settings.num_blocks * self.get_cache_block_size_bytes()

    def get_cache_block_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.get_kv_cache_spec().values())

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        if kv_cache_config.num_blocks != self.settings.num_blocks:
            raise NeuronConfigError(
                f"vLLM settled on {kv_cache_config.num_blocks} KV blocks but the Neuron "
                f"graphs were built for {self.settings.num_blocks} "
                f"(pa_num_blocks, including vLLM's null block); set "
                f"--num-gpu-blocks-override {self.settings.num_blocks} or remove "
                f"conflicting overrides."
            )
        self._runner().bind_kv_cache(kv_cache_config)
        if self.vllm_config.kv_transfer_config is not None:
            self._start_kv_transfer(kv_cache_config)

    def _start_kv_transfer(self, kv_cache_config: KVCacheConfig) -> None:
        """vLLM's worker-side KV connector, bound to the backend that owns the cache
        (the platform admits NeuronKVConnector only: core.kv_transfer)."""
        from vllm.distributed.kv_transfer import (
            ensure_kv_transfer_initialized,
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        from neuron_plugin.kv_transfer.connector import NeuronKVConnector

        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        if not has_kv_transfer_group():
            return
        connector = get_kv_transfer_group()
        if not isinstance(connector, NeuronKVConnector):
            raise NeuronConfigError(
                f"--kv-transfer-config built {type(connector).__name__}, which cannot reach "
                f"a KV cache held by the Neuron backend; use NeuronKVConnector "
                f"(docs/configuration/disaggregation.md)."
            )
        runner = self._runner()
        connector.bind_backend(runner.backend, self.settings, self.adapters)
        self.telemetry.watch(connector.transferred_bytes)
        runner.kv_transfer = KVTransferSteps(connector, self.vllm_config)

    def get_kv_connector_handshake_metadata(self) -> dict | None:
        """vLLM's engine asks every worker when a connector is configured; the plugin's
        connector exchanges nothing at start (the payload carries what it needs)."""
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Compilation and warm-up happen in load_model, through the compile cache.
        return CompilationTimes(language_model=self.load_seconds, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._runner().execute_model(scheduler_output)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self._runner().sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self._runner().take_draft_token_ids()

    def get_model(self) -> torch.nn.Module:
        module = self._runner().backend.module
        if module is None:
            raise RuntimeError(f"the {self.settings.backend} backend holds no torch module")
        return module

    def shutdown(self) -> None:
        if self.vllm_config.kv_transfer_config is not None:
            from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

            ensure_kv_transfer_shutdown()
        self.telemetry.close()
        if self.adapters is not None:
            self.adapters.close()
        close = getattr(self.backend, "close", None)  # a runner process has one
        if close is not None:
            close()
