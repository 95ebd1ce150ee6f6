"""NxD Inference's own CPU mode behind the NxD contract, for accuracy checks of the real
NxDI modelling code on a host without a Neuron device.

`override_neuron_config` `"on_cpu": true` is NxDI's NeuronConfig flag; with it the backend
compiles nothing and loads with NxDI's `NeuronApplicationBase.to_cpu()` (eager modules,
a gloo process group of one, weights sharded from the checkpoint). What tracing does per
bucket on a device the CPU mode must do per call: NxDI's model builder sets the eager
module's `n_positions`, `n_active_tokens` and `prefix_size` from the bucket it traces
(models/model_wrapper.py DecoderModelInstance.get, NxDI 0.9 lines 1548-1570), and
`to_cpu()` builds each module once with default sizes. A forward pre-hook on each
submodel finds the call's bucket the way NxD's router finds a graph, by the exact shapes
of the call's inputs against the submodel's example inputs
(`ModelWrapper.input_generator`), and sets those attributes from it. On the CPU NxDI
returns the KV cache as outputs and copies it into every submodel's
`kv_mgr.past_key_values` (model_base.py `_copy_past_key_values`), which is where the
cache lives."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from neuron_plugin.backends.nxd import graphs
from neuron_plugin.backends.nxd.prompt_graphs import prompt_variant
from neuron_plugin.core.nxdi_cpu_mode import refuse_what_the_cpu_mode_cannot_run
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings


def requested(settings: NeuronSettings) -> bool:
    """Whether the settings ask for NxDI's CPU mode (what that mode cannot run was
    refused when the settings were resolved: core.nxdi_cpu_mode)."""
    refuse_what_the_cpu_mode_cannot_run(settings)
    return bool(settings.passthrough.get("on_cpu"))


def refuse_quantized(settings: NeuronSettings) -> None:
    """Serving a quantized checkpoint is refused in the CPU mode (writing one with NxDI's
    own quantizer, `neuron-plugin quantize`, works there): to_cpu() loads it into NxDI's
    float layers without converting them (NxDI 0.9 application_base.to_cpu never calls
    neuronx-distributed's quantize.convert, which the device path runs in
    model_wrapper.DecoderModelInstance.load_module), so int8 values would be read as
    weights without their scales."""
    if settings.passthrough.get("quantized"):
        raise NeuronConfigError(
            "override_neuron_config.on_cpu=true (NxDI's CPU mode) cannot serve quantized: "
            "true: to_cpu() loads the quantized checkpoint into NxDI's float layers "
            "without converting them (it never calls neuronx-distributed's "
            "quantize.convert), so int8 values would be read as weights without their "
            "scales; serve the same checkpoint on the reference backend (the same "
            "layout) to check its accuracy, or on a device."
        )


def bucket_attributes(
    bucket: int | Sequence[int],
    *,
    prefix_caching: bool,
    token_generation: bool,
    max_context_length: int,
) -> dict[str, int]:
    """The eager module's size attributes for `bucket`, as NxDI's model builder sets them
    when it traces that bucket (DecoderModelInstance.get)."""
    if prefix_caching:
        active, prefix = int(bucket[0]), int(bucket[1])  # type: ignore[index]
        positions = prefix if token_generation else min(prefix + active, max_context_length)
        return {"prefix_size": prefix, "n_active_tokens": active, "n_positions": positions}
    if isinstance(bucket, Sequence):  # batch bucketing: [batch, seq_len]
        return {"n_positions": int(bucket[1])}
    return {"n_positions": int(bucket)}


def _shapes(tensors: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class _Bucket:
    """One compiled bucket as the CPU mode finds it: its example input shapes, the module
    attributes tracing would set, and whether its attention mask must be bool."""

    shapes: list[tuple[int, ...]]
    attributes: dict[str, int]
    bool_mask: bool


def _bucket_table(wrappers: Sequence[Any]) -> list[_Bucket]:
    """Every bucket of `wrappers`. A prefill over a cached prefix hands NxDI's integer
    prefix mask to `torch.where` (model_base.py 198-200, attention_base.py 1425 for
    prefill buckets under 128), which traced graphs accept and eager torch refuses, so
    those calls get the same mask as bool."""
    table = []
    for wrapper in wrappers:
        config = wrapper.neuron_config
        token_generation = wrapper.config.neuron_config.n_active_tokens == 1
        for bucket, example in zip(config.buckets, wrapper.input_generator(), strict=True):
            attributes = bucket_attributes(
                bucket,
                prefix_caching=bool(config.is_prefix_caching),
                token_generation=token_generation,
                max_context_length=config.max_context_length,
            )
            table.append(
                _Bucket(
                    _shapes(example),
                    attributes,
                    not token_generation and attributes.get("prefix_size", 0) > 0,
                )
            )
    return table


def _install_bucket_hook(module: torch.nn.Module, wrappers: Sequence[Any]) -> None:
    """Before each call of `module`, set the attributes of the bucket whose example
    inputs have the call's shapes. Without continuous batching `to_cpu()` gives every
    submodel one module, so its table spans all of them."""
    table = _bucket_table(wrappers)

    def set_bucket(hooked: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        call = _shapes(args)
        found = next((bucket for bucket in table if bucket.shapes == call), None)
        if found is None:
            raise ValueError(
                f"NxDI CPU mode: a call with input shapes {call} matches no compiled "
                f"bucket of {[w.tag for w in wrappers]}; this is a plugin bug, please "
                f"report it with your override_neuron_config."
            )
        for name, value in found.attributes.items():
            setattr(hooked, name, value)
        return (args[0], args[1].bool(), *args[2:]) if found.bool_mask else None

    module.register_forward_pre_hook(set_bucket)


def identity_markers(markers: ModuleType) -> None:
    """NxD's layer-boundary markers as the identity. Some decoder layers always wrap
    themselves in them (Qwen3-MoE: modeling_qwen3_moe.py NeuronQwen3MoeDecoderLayer
    .forward, ef2731e lines 410 and 437), and each is a Neuron custom call
    (models/layer_boundary_marker.py: xla_hlo_call with AwsNeuronModuleMarker*Forward), a
    hint to neuronx-cc's modular flow that returns its inputs and that only the device can
    run. On a device the markers stay NxDI's; in the CPU mode they return their inputs."""
    for name in ("ModuleMarkerStartWrapper", "ModuleMarkerEndWrapper"):
        wrapper = getattr(markers, name, None)
        if wrapper is not None:
            wrapper.forward = _inputs


def _inputs(self: torch.nn.Module, *args: Any) -> Any:
    return args[0] if len(args) == 1 else args


def _free_master_port() -> None:
    """to_cpu() starts a gloo process group of one on MASTER_PORT, 29500 unless set
    (application_base.py to_cpu, ef2731e lines 579-586): a second engine on the host (data
    parallelism, a second server) would fail with "address already in use", so an unset
    MASTER_PORT becomes a free one."""
    if not torch.distributed.is_initialized() and "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])


def load(model: Any, markers: ModuleType) -> None:
    """Build NxDI's eager submodels on the CPU and hook their per-bucket attributes, with
    NxD's layer-boundary markers as the identity (`identity_markers`). The
    token-generation logits submodel (`graphs`) and the prompt-logprob one
    (`prompt_graphs`) read the KV cache of the submodel they stand in for: NxDI copies
    each call's cache into token_generation_model and context_encoding_model only
    (model_base.py `_copy_past_key_values`). See `_free_master_port` for the port."""
    _free_master_port()
    identity_markers(markers)
    model.to_cpu()
    _share_caches_and_hook(model)


def _share_caches_and_hook(model: Any) -> None:
    prompt = prompt_variant(model)
    # The prompt-logprob submodel stands in for context_encoding_model during its calls,
    # so NxDI's copy would miss the context encoder's own cache then: it shares it too.
    sharing = (graphs.logits_variant(model), prompt, prompt and model.context_encoding_model)
    variants = [variant for variant in sharing if variant is not None]
    # a fused application (a draft model, EAGLE) has no token_generation_model, and none
    # of these variants (core.settings refuses prompt logprobs with one)
    for variant in variants:
        plain = model.token_generation_model
        if variant.model is not plain.model:
            variant.model.kv_mgr.past_key_values = plain.model.kv_mgr.past_key_values
    by_module: dict[int, tuple[torch.nn.Module, list[Any]]] = {}
    for wrapper in model.models:
        by_module.setdefault(id(wrapper.model), (wrapper.model, []))[1].append(wrapper)
    for module, wrappers in by_module.values():
        _install_bucket_hook(module, wrappers)


def load_image_to_text(model: Any, markers: ModuleType) -> None:
    """NxDI's CPU mode for an image-to-text application, which `to_cpu()` cannot load:
    without continuous batching it builds the text module from the full config, whose
    top level lacks the text model's sizes (Qwen3-VL: vocab_size, hidden_size), and it
    never builds the vision encoder (it loads `self.models`, the text wrappers:
    application_base.py to_cpu, 0.8 cd3abf3 lines 554-626, 0.9 ef2731e 556-628). This
    does what to_cpu does (the gloo group of one, model parallel state, a sharded
    checkpoint per module), with one module per text wrapper from that wrapper's config
    (to_cpu's continuous-batching rule, for every application) and one for the vision
    encoder from its own; the checkpoint is always sharded, at TP 1 too. The text
    modules then get the per-bucket hook and the shared caches of `load`."""
    from neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    _free_master_port()
    identity_markers(markers)
    os.environ["NXD_CPU_MODE"] = "1"
    neuron_config = model.neuron_config
    if not torch.distributed.is_initialized():
        if neuron_config.world_size != 1:
            raise NeuronConfigError(
                f"NxDI's CPU mode with world_size={neuron_config.world_size}: start the "
                f"engine under torchrun (one process per rank), or serve at tp_degree 1."
            )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        torch.distributed.init_process_group(backend="gloo", world_size=1, rank=0)
    initialize_model_parallel(
        tensor_model_parallel_size=neuron_config.tp_degree,
        pipeline_model_parallel_size=neuron_config.pp_degree,
        expert_model_parallel_size=neuron_config.ep_degree,
        skip_collective_init=True,
    )

    def built(wrapper: Any) -> torch.nn.Module:
        module = wrapper.model_cls(wrapper.config)
        if wrapper.config.neuron_config.torch_dtype == torch.bfloat16:
            module.bfloat16()
        weights = model.checkpoint_loader_fn()
        get_sharded_checkpoint(
            weights, module, torch.distributed.get_rank(), neuron_config.tp_degree
        )
        module.load_state_dict(weights, strict=False)
        return module.eval()

    for wrapper in [*model.text_models, *model.vision_models]:
        wrapper.model = built(wrapper)
    model.eval()
    _share_caches_and_hook(model)


def kv_cache_tensors(model: Any) -> list[torch.Tensor]:
    """The KV cache as NxDI's CPU mode holds it (one tensor per layer and K/V)."""
    return list(model.token_generation_model.model.kv_mgr.past_key_values)
