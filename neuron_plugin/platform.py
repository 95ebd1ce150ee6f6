"""NeuronPlatform: vLLM defaults and checks for Neuron, the worker class, request checks.

Neuron runs precompiled static graphs, so the platform shapes vLLM's scheduler around
them: whole prompts per step (no chunked prefill unless asked for), one KV block per
sequence in the contiguous layout, the exact block count the graphs were built for, and
synchronous steps. Every value it changes is logged with the reason; a combination that
cannot work raises `NeuronConfigError` before anything compiles.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from typing import Any

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from neuron_plugin import BACKEND_ENV, plugin_logger
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.instances import package_version, parse_core_list
from neuron_plugin.core.prompt_logprobs import PROMPT_LOGPROBS_KEY
from neuron_plugin.core.sampling import on_device_refusal, sampling_summary
from neuron_plugin.core.speculation import host_sampling_refusal, speculation_summary
from neuron_plugin.core.threads import (
    API_SERVER,
    apply_serving_threads,
    available_cores,
    serves_api,
    serving_threads,
)
from neuron_plugin.core.vision import vision_bucket
from neuron_plugin.core.vllm_builds import TESTED, installed_vllm
from neuron_plugin.serving.images import image_patches
from neuron_plugin.serving.vllm_settings import (
    apply,
    resolve_from_vllm_config,
    resolved_kv_transfer_config,
    resolved_settings,
)

logger = plugin_logger(__name__)

PREFIX_CACHING_EVIDENCE = (
    "prefix caching with bucketing measured 40-45% slower on inf2 (59 -> 86 ms per batch "
    "of 4 even at full cache hits) because it switches NxDI to the block KV layout"
)


ADDITIONAL_CONFIG_EXAMPLE = (
    '--additional-config \'{"override_neuron_config": {"skip_warmup": true}}\''
)


def additional_config_json(value: str) -> dict[str, Any]:
    """`--additional-config`'s value: one JSON object (vLLM's own parser reports a bad
    one as a Python function's repr or as a type error, naming neither flag nor fix)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not valid JSON ({exc.msg} at character {exc.pos}); pass one "
            f"JSON object in single quotes, e.g. {ADDITIONAL_CONFIG_EXAMPLE}"
        ) from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a JSON {type(parsed).__name__}, not an object; pass e.g. "
            f"{ADDITIONAL_CONFIG_EXAMPLE}"
        )
    return parsed


def max_num_seqs(value: str) -> int | None:
    """`--max-num-seqs`: the number of sequence slots the graphs are compiled for."""
    if value in ("", "None"):
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} must be a whole number >= 1: the requests decoded together, one "
            f"KV-cache slot each (e.g. --max-num-seqs 4), or leave the flag out for "
            f"vLLM's default"
        )
    return int(value)


def refuse_override_flag(value: str) -> None:
    """vLLM <= 0.9's `--override-neuron-config JSON`, gone from vLLM's EngineArgs: name
    the spelling that replaced it."""
    raise argparse.ArgumentTypeError(
        f"this flag of vLLM's old Neuron integration no longer exists; pass "
        f"--additional-config '{{\"override_neuron_config\": {value}}}' instead"
    )


# vLLM flags whose values the platform parses itself, for messages naming flag and fix.
CHECKED_FLAGS = {"--additional-config": additional_config_json, "--max-num-seqs": max_num_seqs}


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

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def is_cpu(self) -> bool:
        """Every tensor vLLM holds here is a host tensor (NxDI owns device memory), and
        vLLM's host-side choices follow this answer: its workers keep their thread
        count (`set_multiprocessing_worker_envs` in v1/executor/multiproc_executor.py
        pins OMP_NUM_THREADS otherwise), streams are placeholders
        (`utils/torch_utils.py`), no Triton warm-ups are registered. The one place it
        would reach for the CPU build's compiled ops, the Sampler, is pinned to vLLM's
        PyTorch code (`serving.host_sampling.HostRowsSampler`), so this holds on every
        vLLM build."""
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "neuron"

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Nothing to select per thread: vLLM's tensors live on the host, and the
        backend's NeuronCores are fixed per process by NEURON_RT_VISIBLE_CORES. vLLM's
        multiprocess executor calls this from its async-output thread (async
        scheduling); the base class raises, which killed that thread and hung the
        engine."""

    @classmethod
    def device_id_to_physical_device_id(cls, device_id: int) -> int:
        """vLLM reads the device variable as a comma list when it sizes data-parallel
        ranks; `NEURON_RT_VISIBLE_CORES` also takes ranges ("4-7", "0-1,6"), so read it
        the way the Neuron runtime does. An IndexError past the last core is what vLLM
        expects; ids vLLM assigned itself take precedence, as in its own reading."""
        from vllm.platforms import interface

        value = os.environ.get(cls.device_control_env_var, "")
        if interface._assigned_physical_gpu_ids is not None or "-" not in value:
            return super().device_id_to_physical_device_id(device_id)
        return parse_core_list(value)[device_id]

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        """vLLM's hybrid KV cache manager allocates a hybrid model's state blocks beside
        its attention blocks (core.recurrent_state); every other model the plugin serves
        reports one full-attention spec per layer, one group, which it leaves as it was."""
        return True

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return 0.0

    @classmethod
    def import_kernels(cls) -> None:
        """Nothing to import: the plugin calls no op from vLLM's kernel libraries. The
        `vllm` wheel's are CUDA kernels with no device here (the wheel for 0.33 ships
        no `vllm._C` at all), and the CPU build's default `_C` needs AVX512 (an
        AVX2-only host dies with SIGILL importing it)."""

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
        warn (see check_and_update_config). `CHECKED_FLAGS` get parsers whose errors
        name the flag and the fix; vLLM <= 0.9's --override-neuron-config is refused
        with its replacement."""
        if parser is None:
            return
        actions = {opt: action for action in parser._actions for opt in action.option_strings}
        if "--device" not in actions:
            parser.add_argument(
                "--device",
                choices=["neuron"],
                default="neuron",
                help="Run on AWS Neuron through the neuron_plugin platform (the "
                f"reference CPU backend when no Neuron device exists; choose with "
                f"{BACKEND_ENV}=nxd|reference).",
            )
        if "--override-neuron-config" not in actions:
            parser.add_argument(
                "--override-neuron-config", type=refuse_override_flag, help=argparse.SUPPRESS
            )
        for flag, parse in CHECKED_FLAGS.items():
            if flag in actions:
                actions[flag].type = parse
        parser.set_defaults(enable_prefix_caching=False, enable_chunked_prefill=False)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """Resolve the Neuron settings from vLLM's untouched config and write back what
        vLLM must know (see `serving.vllm_settings`); refuse what cannot work."""
        if vllm_config.model_config is None:
            return
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        if cache.enable_prefix_caching:
            logger.warning(
                "neuron platform: prefix caching is on; %s. Pass "
                "--no-enable-prefix-caching (LLM: enable_prefix_caching=False) "
                "unless prompts share long prefixes.",
                PREFIX_CACHING_EVIDENCE,
            )
        else:
            logger.info(
                "neuron platform: prefix caching off by default on Neuron (%s); "
                "--enable-prefix-caching turns it on.",
                PREFIX_CACHING_EVIDENCE,
            )
        if sched.enable_chunked_prefill:
            logger.warning(
                "neuron platform: chunked prefill is on, which needs the block "
                "KV layout and 2-D (chunk x prefix) context-encoding graphs; "
                "pass --no-enable-chunked-prefill (LLM: "
                "enable_chunked_prefill=False) to encode whole prompts."
            )
        build = installed_vllm(package_version)
        if build is not None and build.tested_by() is None:
            logger.warning(
                "neuron platform: %s is not a tested pair of release and build (tested: "
                "%s); `neuron-plugin doctor` says what to install",
                build.describe(),
                ", ".join(f"{release} {kind}" for release, kind in TESTED),
            )
        settings = resolve_from_vllm_config(vllm_config)
        apply(settings, vllm_config)
        if serves_api(sys.argv, os.environ, multiprocessing.parent_process() is not None):
            # vLLM's API server computes no model: one torch thread (core.threads)
            apply_serving_threads(
                API_SERVER, serving_threads(API_SERVER, cores=available_cores()), logger
            )
        if settings.max_loras:
            from neuron_plugin.serving.lora_api import install

            install()  # in vLLM's API server: a refused adapter is HTTP 400, not 500
        logger.info(
            "neuron platform: backend=%s%s, KV layout %s (%s), block_size=%d, blocks=%d, "
            "context-encoding buckets %s%s, token-generation buckets %s x batches %s%s, "
            "%d graphs",
            settings.backend,
            f" (runner: {settings.backend_python})" if settings.backend_python else "",
            settings.kv_layout,
            settings.kv_layout_reason,
            settings.block_size,
            settings.num_blocks,
            list(settings.context_encoding_buckets),
            f" x prefix {list(settings.prefix_buckets)}" if settings.prefix_buckets else "",
            list(settings.token_generation_buckets),
            list(settings.token_generation_batches),
            f" ({settings.token_generation_batches_reason})"
            if settings.token_generation_batches_reason
            else "",
            settings.graph_count(),
        )
        logger.info("neuron platform: KV cache capacity %s", settings.capacity())
        logger.info(
            "neuron platform: %s",
            sampling_summary(
                settings.on_device_sampling, settings.global_topk, settings.exact_sampling
            ),
        )
        if settings.logits_buckets_note:
            # twins missing where default requests need them cost every such decode step
            short = settings.token_generation_logits_buckets != settings.token_generation_buckets
            (logger.warning if short else logger.info)(
                "neuron platform: %s", settings.logits_buckets_note
            )
        speculation = speculation_summary(
            settings.speculation_method, settings.num_speculative_tokens, settings.backend
        )
        if speculation:
            # On nxd the summary says sampled requests decode greedily: a warning there.
            log = logger.warning if settings.backend == "nxd" else logger.info
            log("neuron platform: %s", speculation)

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Reject, with the limit and the fix, what no compiled graph can serve. vLLM
        answers a VLLMValidationError with HTTP 400 and keeps serving."""
        from vllm.exceptions import VLLMValidationError

        settings = resolved_settings()
        if settings is None:
            return
        if (
            getattr(params, "prompt_logprobs", None) is not None
            and settings.prompt_logprobs is None
        ):
            raise VLLMValidationError(
                "log-probabilities of prompt tokens need the prompt-logprob graphs, which "
                "this server did not compile. prompt_logprobs asks for them, and so does "
                "echo=true with logprobs in /v1/completions or echo=true in "
                "/v1/chat/completions; start the server with --additional-config "
                f"'{{\"{PROMPT_LOGPROBS_KEY}\": true}}' (they are compiled beside the "
                "context-encoding graphs), or remove prompt_logprobs or drop echo "
                "(logprobs of generated tokens work).",
                parameter="prompt_logprobs",
                value=params.prompt_logprobs,
            )
        if settings.on_device_sampling:
            why = on_device_refusal(params, settings.global_topk, settings.exact_sampling)
            refusal = why and host_sampling_refusal(settings, f"this request's {why}")
            if refusal:
                raise VLLMValidationError(refusal, parameter="sampling_params", value=why)
        token_ids = (
            processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
        )
        kv_config = resolved_kv_transfer_config()
        if kv_config is not None:
            from neuron_plugin.kv_transfer.admission import check_request

            check_request(kv_config, params, None if token_ids is None else len(token_ids))
        if settings.vision_buckets and isinstance(processed_inputs, dict):
            for patches in image_patches(processed_inputs):
                try:
                    vision_bucket(settings.vision_buckets, patches)
                except NeuronConfigError as exc:
                    raise VLLMValidationError(
                        str(exc), parameter="image", value=f"{patches} patches"
                    ) from None
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
                parameter="input_tokens",
                value=len(token_ids),
            )
