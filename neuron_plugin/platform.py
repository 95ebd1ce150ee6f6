"""NeuronPlatform: vLLM defaults and checks for Neuron, the worker class, request checks.

Neuron runs precompiled static graphs, so the platform shapes vLLM's scheduler around
them: whole prompts per step (no chunked prefill unless asked for), one KV block per
sequence in the contiguous layout, the exact block count the graphs were built for, and
synchronous steps. Every value it changes is logged with the reason; a combination that
cannot work raises `NeuronConfigError` before anything compiles.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from neuron_plugin.config import NeuronConfigError, NeuronSettings
from neuron_plugin import plugin_logger
from neuron_plugin.telemetry import install_metrics_collector
from neuron_plugin.settings_store import (
    BACKEND_ENV,
    resolve_from_vllm_config,
    selected_backend,
    store_settings,
)

logger = plugin_logger(__name__)

WORKER_CLS = "neuron_plugin.worker.NeuronWorker"
PREFIX_CACHING_EVIDENCE = (
    "prefix caching with bucketing measured 40-45% slower on inf2 (59 -> 86 ms per batch "
    "of 4 even at full cache hits) because it switches NxDI to the block KV layout"
)


def _change(target: Any, name: str, value: Any, reason: str, label: str) -> None:
    old = getattr(target, name)
    if old != value:
        setattr(target, name, value)
        logger.info("neuron platform: %s %r -> %r (%s)", label, old, value, reason)


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    # NxDI takes host tensors and manages device memory itself; vLLM-side tensors
    # (inputs, sampler) live on the CPU, and vLLM builds torch devices from these names.
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var: str = "NEURON_RT_VISIBLE_CORES"
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    # Resolved in the process that builds the VllmConfig (the API server or LLM), read
    # by validate_request in the same process.
    _settings: NeuronSettings | None = None

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def is_cpu(self) -> bool:
        """vLLM-side work (inputs, sampling, cleanup) runs on host tensors; NxDI owns
        device memory. vLLM gates its host code paths on this (e.g. it skips
        torch.accelerator calls, which have no device to act on here)."""
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "neuron"

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        return 0.0

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM flags unknown VLLM_* variables; this plugin's own are known here."""
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("VLLM_NEURON_")}
        try:
            super().validate_environ(hard_fail)
        finally:
            os.environ.update(saved)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Add `--device neuron` (vLLM 0.32 has no --device) and make prefix caching and
        chunked prefill opt-in on the command line: both switch NxDI to the block KV
        layout (see PREFIX_CACHING_EVIDENCE). The Python `LLM` API resolves vLLM's
        defaults before any platform hook sees them, so there the platform can only
        warn (see check_and_update_config)."""
        if parser is None:
            return
        known = {opt for action in parser._actions for opt in action.option_strings}
        if "--device" not in known:
            parser.add_argument(
                "--device", choices=["neuron"], default="neuron",
                help="Run on AWS Neuron through the neuron_plugin platform (the "
                     f"reference CPU backend when no Neuron device exists; choose with "
                     f"{BACKEND_ENV}=nxd|reference).")
        parser.set_defaults(enable_prefix_caching=False, enable_chunked_prefill=False)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        if vllm_config.model_config is None:
            return
        model, cache, sched = (vllm_config.model_config, vllm_config.cache_config,
                               vllm_config.scheduler_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        if vllm_config.lora_config is not None:
            raise NeuronConfigError(
                "LoRA (--enable-lora) is not supported by the neuron_plugin platform "
                "yet; remove --enable-lora or merge the adapter into the weights.")
        if vllm_config.speculative_config is not None:
            raise NeuronConfigError(
                "speculative decoding (--speculative-config) is not supported by the "
                "neuron_plugin platform yet; remove --speculative-config.")
        _change(sched, "async_scheduling", False,
                "host sampling needs each step's logits before the next step",
                "async_scheduling")
        if parallel.world_size > 1:
            _change(parallel, "distributed_executor_backend", "uni",
                    "NxDI shards across NeuronCores inside one process",
                    "distributed_executor_backend")
        if cache.enable_prefix_caching:
            logger.warning("neuron platform: prefix caching is on; %s. Pass "
                           "--no-enable-prefix-caching (LLM: enable_prefix_caching=False) "
                           "unless prompts share long prefixes.", PREFIX_CACHING_EVIDENCE)
        else:
            logger.info("neuron platform: prefix caching off by default on Neuron (%s); "
                        "--enable-prefix-caching turns it on.", PREFIX_CACHING_EVIDENCE)
        if sched.enable_chunked_prefill:
            logger.warning("neuron platform: chunked prefill is on, which needs the block "
                           "KV layout and 2-D (chunk x prefix) context-encoding graphs; "
                           "pass --no-enable-chunked-prefill (LLM: "
                           "enable_chunked_prefill=False) to encode whole prompts.")
        block_layout = cache.enable_prefix_caching or sched.enable_chunked_prefill
        # Without chunked prefill vLLM itself keeps max_num_batched_tokens >=
        # max_model_len, so a whole prompt always fits one step (one graph).
        if not block_layout:
            _change(cache, "block_size", model.max_model_len,
                    "contiguous KV layout: one block per sequence", "block_size")
        elif not cache.user_specified_block_size:
            from neuron_plugin.config import DEFAULT_BLOCK_SIZE

            _change(cache, "block_size", DEFAULT_BLOCK_SIZE,
                    "block KV layout default (the block size the findings measured)",
                    "block_size")
        settings = resolve_from_vllm_config(vllm_config, selected_backend())
        _change(cache, "num_gpu_blocks_override", settings.num_blocks,
                f"{settings.kv_layout} KV layout needs exactly the block count the graphs "
                f"are compiled for (NxDI pa_num_blocks, including vLLM's null block)",
                "num_gpu_blocks_override")
        store_settings(vllm_config, settings)
        cls._settings = settings
        install_metrics_collector()
        logger.info(
            "neuron platform: backend=%s, KV layout %s (%s), block_size=%d, blocks=%d, "
            "context-encoding buckets %s%s, token-generation buckets %s x batches %s, "
            "%d graphs", settings.backend, settings.kv_layout, settings.kv_layout_reason,
            settings.block_size, settings.num_blocks,
            list(settings.context_encoding_buckets),
            f" x prefix {list(settings.prefix_buckets)}" if settings.prefix_buckets else "",
            list(settings.token_generation_buckets),
            list(settings.token_generation_batches), settings.graph_count())

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Reject, with the limit and the fix, what no compiled graph can serve. vLLM
        answers a VLLMValidationError with HTTP 400 and keeps serving."""
        from vllm.exceptions import VLLMValidationError

        settings = cls._settings
        if settings is None:
            return
        if getattr(params, "prompt_logprobs", None) is not None:
            raise VLLMValidationError(
                "prompt_logprobs is not supported on Neuron: the compiled graphs return "
                "logits for the last prompt token only; remove prompt_logprobs.",
                parameter="prompt_logprobs", value=params.prompt_logprobs)
        token_ids = processed_inputs.get("prompt_token_ids") if isinstance(
            processed_inputs, dict) else None
        if token_ids is None or settings.is_chunked_prefill:
            return
        largest = max(settings.context_encoding_buckets)
        if len(token_ids) > largest:
            raise VLLMValidationError(
                f"prompt has {len(token_ids)} tokens but the largest context-encoding "
                f"bucket holds {largest} (context_encoding_buckets="
                f"{list(settings.context_encoding_buckets)}); shorten the prompt or add a "
                f"bucket >= {len(token_ids)} in override_neuron_config."
                f"context_encoding_buckets (at most max_model_len={settings.max_model_len}).",
                parameter="input_tokens", value=len(token_ids))
