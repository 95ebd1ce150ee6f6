"""vLLM engine flags this platform cannot honour, each refused before start-up with the
reason and the fix.

vLLM accepts every flag of its EngineArgs on any platform; on Neuron many would be read
by nothing (a quantized KV cache, CPU offload), or hang start-up (pipeline parallelism
waits at gloo initialisation for stages that never come). `VLLM_FLAGS` lists them with
where vLLM's config holds each value; `serving.vllm_settings` reads those values into
`EngineLimits.vllm_flags`, and `core.settings.resolve_settings` refuses every value
outside `served`. Pure: no vLLM import.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WORKER_CLS = "neuron_plugin.serving.worker.NeuronWorker"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: where VllmConfig holds its value and which values Neuron serves."""

    flag: str  # as on `vllm serve`'s command line
    path: str  # dotted attribute path from VllmConfig
    served: tuple[Any, ...]
    reason: str
    fix: str
    # Values served for one architecture only (Hugging Face architecture -> values).
    served_for: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def refusal(self, value: Any, architecture: str = "") -> str | None:
        """The error message for `value` (served to `architecture`), or None when Neuron
        serves it."""
        if value in self.served or value in self.served_for.get(architecture, ()):
            return None
        argument = self.flag.removeprefix("--").replace("-", "_")
        if isinstance(value, enum.Enum):
            value = value.name
        if value is True or not isinstance(value, (str, int, float, dict)):
            given = f"{self.flag} ({argument})"
        else:
            shown = json.dumps(value) if isinstance(value, dict) else value
            given = f"{self.flag} {shown} ({argument}={value!r})"
        return f"{given} is not supported on Neuron: {self.reason}; {self.fix}."


_NO_GPU_KV = (
    "the KV cache lives in the compiled NxD graphs' device memory, which vLLM's "
    "cache managers never see"
)
_WEIGHTS_ON_DEVICE = "weights live in NeuronCore memory inside the compiled graphs"
_NOT_GENERATE = (
    "the Neuron model runner serves text generation only (no pooling, embedding or scoring graphs)"
)
_OTHER_PLATFORM = "serve this model with vLLM's own platform (without --device neuron)"

VLLM_FLAGS = (
    VllmFlag(
        "--kv-cache-dtype",
        "cache_config.cache_dtype",
        ("auto",),
        "the compiled graphs keep the KV cache in the model's dtype (--dtype) and "
        "never read vLLM's KV-cache dtype",
        "remove --kv-cache-dtype",
    ),
    VllmFlag(
        "--pipeline-parallel-size",
        "parallel_config.pipeline_parallel_size",
        (1,),
        "NxDI shards a model over NeuronCores with tensor parallelism inside one "
        "process, so pipeline stages would wait for each other at start-up forever",
        "use --tensor-parallel-size N (N NeuronCores) instead",
    ),
    VllmFlag(
        "--decode-context-parallel-size",
        "parallel_config.decode_context_parallel_size",
        (1,),
        "context parallelism is a feature of vLLM's GPU attention kernels, which do not run here",
        "remove --decode-context-parallel-size",
    ),
    VllmFlag(
        "--enable-expert-parallel",
        "parallel_config.enable_expert_parallel",
        (False,),
        "experts are sharded inside the compiled NxD graphs",
        "remove it and set NxDI's moe_ep_degree / moe_tp_degree in override_neuron_config",
    ),
    VllmFlag(
        "--distributed-executor-backend",
        "parallel_config.distributed_executor_backend",
        (None, "uni", "mp"),
        "NxDI shards across NeuronCores inside one process (vLLM's uni executor)",
        "remove --distributed-executor-backend",
    ),
    VllmFlag(
        "--cpu-offload-gb",
        "offload_config.uva.cpu_offload_gb",
        (0, 0.0),
        _WEIGHTS_ON_DEVICE,
        "remove it; a larger --tensor-parallel-size spreads the weights over more NeuronCores",
    ),
    VllmFlag(
        "--offload-group-size",
        "offload_config.prefetch.offload_group_size",
        (0,),
        _WEIGHTS_ON_DEVICE,
        "remove --offload-group-size",
    ),
    VllmFlag(
        "--kv-offloading-size",
        "cache_config.kv_offloading_size",
        (None,),
        _NO_GPU_KV,
        "remove --kv-offloading-size",
    ),
    VllmFlag(
        "--kv-cache-memory-bytes",
        "cache_config.kv_cache_memory_bytes",
        (None,),
        "the KV cache holds exactly the blocks the graphs are compiled for",
        "size it with --max-num-seqs (and --num-gpu-blocks-override in the block layout)",
    ),
    VllmFlag(
        "--ec-transfer-config",
        "ec_transfer_config",
        (None,),
        "encoder-cache transfer (encoder/prefill/decode disaggregation) moves vision "
        "embeddings between instances, which this plugin's workers do not connect",
        "remove --ec-transfer-config",
    ),
    VllmFlag(
        "--quantization",
        "model_config.quantization",
        (None,),
        "vLLM's quantized kernels do not run on NeuronCores (a quantization_config "
        "in the checkpoint's config.json sets this too)",
        "serve the unquantized checkpoint with override_neuron_config keys quantized: "
        "true and quantized_checkpoints_path (NxDI's weight quantization; `neuron-plugin "
        "quantize` writes that checkpoint)",
        # gpt-oss as openai ships it: MXFP4 experts, which both backends read (NxDI
        # dequantizes them at load; core.mxfp4 for the reference backend). vLLM names the
        # checkpoint's quant_method mxfp4 gpt_oss_mxfp4 (GptOssMxfp4Config).
        served_for={"GptOssForCausalLM": ("mxfp4", "gpt_oss_mxfp4")},
    ),
    VllmFlag(
        "--enable-prompt-embeds",
        "model_config.enable_prompt_embeds",
        (False,),
        "the compiled graphs take token ids",
        "remove it and send prompts as text or token ids",
    ),
    VllmFlag(
        "--runner",
        "model_config.runner_type",
        ("generate",),
        _NOT_GENERATE,
        f"remove --runner, or {_OTHER_PLATFORM}",
    ),
    VllmFlag(
        "--convert",
        "model_config.convert_type",
        ("none",),
        _NOT_GENERATE,
        f"remove --convert, or {_OTHER_PLATFORM}",
    ),
    VllmFlag(
        "--hf-overrides",
        "model_config.hf_overrides",
        ({},),
        "the backend builds the model from the checkpoint's own config.json, so "
        "the overrides would change vLLM's view of the model but not the graphs",
        "edit config.json in a copy of the checkpoint instead",
    ),
    VllmFlag(
        "--load-format",
        "load_config.load_format",
        ("auto", "safetensors"),
        "the backend reads the checkpoint's *.safetensors files itself",
        "remove --load-format (convert other formats to safetensors first)",
    ),
    VllmFlag(
        "--attention-backend",
        "attention_config.backend",
        (None,),
        "attention runs inside the compiled NxD graphs, not in a vLLM attention backend",
        "remove --attention-backend",
    ),
    VllmFlag(
        "--worker-cls",
        "parallel_config.worker_cls",
        ("auto", WORKER_CLS),
        "the Neuron worker drives the backend",
        "remove --worker-cls",
    ),
)


def flag_problems(values: Mapping[str, Any], architecture: str = "") -> list[str]:
    """One message per flag in `values` (flag -> vLLM's value) that Neuron cannot serve
    to `architecture`."""
    return [
        message
        for flag in VLLM_FLAGS
        if flag.flag in values
        if (message := flag.refusal(values[flag.flag], architecture)) is not None
    ]
