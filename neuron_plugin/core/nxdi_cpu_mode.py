"""What NxDI's own CPU mode (`override_neuron_config` `"on_cpu": true`, the nxd backend's
accuracy-check mode) cannot run, refused when the settings are resolved: before vLLM
starts an engine, so `vllm serve` and `neuron-plugin validate` name the setting and the
fix at once (the backend's `cpu_mode.requested` checks again where settings arrive
resolved). Batch bucketing runs there: a decode batch below the compiled one takes
NxDI's CPU padding path, which unpacks `logits, *kv_caches = outputs` (model_wrapper.py
forward) and so fails on a graph that returns logits beside tokens; the batch-bucketed
graphs return tokens alone and the logits graphs run at the full batch (nxd `graphs`).
Serving a quantized checkpoint is refused at load instead (`cpu_mode.refuse_quantized`):
`neuron-plugin quantize` writes one in this mode."""

from __future__ import annotations

import os

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import NeuronSettings


def sharded_sampler_problem(settings: NeuronSettings) -> str | None:
    """Why NxDI's CPU mode cannot sample on the device at TP > 1 (None where it can): its
    sampler takes each rank's own vocabulary shard (sampling.py Sampler._argmax_sample,
    whose on_cpu branch skips the distributed argmax; measured on 0.8 and 0.9 at TP 2:
    every token below the shard size, different per rank). Its logits are right (the
    logits graphs gather the shards whole), so only `run` is refused."""
    if not settings.passthrough.get("on_cpu") or settings.tp_degree == 1:
        return None
    return (
        f"NxDI's CPU mode samples each rank's own vocabulary shard at "
        f"--tensor-parallel-size {settings.tp_degree} (Sampler._argmax_sample's on_cpu "
        f"branch has no distributed argmax), so its tokens are wrong there; read the "
        f"logits (forward) instead, or sample on NeuronCores"
    )


def refuse_what_the_cpu_mode_cannot_run(settings: NeuronSettings) -> None:
    """Raise, naming each problem and its fix, when `on_cpu` asks NxDI's CPU mode for
    what it cannot run (NxDI 0.9 application_base.to_cpu)."""
    if not settings.passthrough.get("on_cpu"):
        return
    problems = []
    if settings.tp_degree > 1 and os.environ.get("WORLD_SIZE") != str(settings.tp_degree):
        problems.append(
            f"--tensor-parallel-size {settings.tp_degree}: to_cpu() needs one process per "
            f"rank, started by torchrun (WORLD_SIZE={settings.tp_degree}), and vLLM runs "
            f"the backend in one; use 1, or drive the backend under `torchrun "
            f"--nproc-per-node {settings.tp_degree}` to check a sharded model's accuracy"
        )
    if settings.max_loras:
        problems.append(
            "--enable-lora: the CPU mode copies every graph output after the logits into "
            "the KV cache (model_base.py _copy_past_key_values), and LoRA adds its "
            "weight_active tensors to those outputs (NeuronBaseModel.forward, "
            "`outputs += lora_weights`): measured with NxDI 0.9, the first call fails "
            "with IndexError; serve LoRA on the reference backend or on a device"
        )
    if settings.dtype == "float16":
        problems.append(
            "--dtype float16: NxDI's CPU mode refuses it; use float32 (what an "
            "accuracy check against transformers wants) or bfloat16"
        )
    if settings.speculation_method:
        problems.append(
            f"--speculative-config method {settings.speculation_method!r}: to_cpu() "
            f"refuses any speculation_length ('Speculation is not yet supported for CPU "
            f"inference.', application_base.py to_cpu, ef2731e lines 571-572); remove "
            f"--speculative-config for the CPU mode, or remove on_cpu to speculate on "
            f"NeuronCores"
        )
    continuous = settings.passthrough.get("is_continuous_batching", settings.max_num_seqs > 1)
    if settings.prompt_logprobs is not None and not continuous:
        problems.append(
            "additional_config.prompt_logprobs=true without continuous batching: to_cpu() "
            "then builds one module, of the first submodel's class, for every submodel "
            "(application_base.py to_cpu), so the prompt-logprob submodel would run the "
            "plain context encoding; use --max-num-seqs 2 or more (or "
            "is_continuous_batching: true)"
        )
    if problems:
        raise NeuronConfigError(
            "override_neuron_config.on_cpu=true (NxDI's CPU mode) "
            "cannot run " + "; ".join(problems) + "."
        )
