"""Multi-LoRA: which of vLLM's LoRA settings Neuron serves, and the shapes they compile in.

Adapters are data, not graphs. `--enable-lora` compiles a fixed set of adapter slots
into every graph: for each decoder layer and each target module (`--lora-target-modules`,
default every projection of a dense decoder layer) an A tensor [slots, max_lora_rank, in]
and a B tensor [slots, out, max_lora_rank], with slots = `--max-loras` + 1. Slot 0 stays
zero and serves the rows without an adapter (NxDI 0.9's `enable_base_model_only` does the
same); loading an adapter writes its weights into a free slot (`core.adapters`) without
recompiling. Every call carries a slot index per row. The compile-cache key therefore
covers `max_loras`, `max_lora_rank` and the target modules, never an adapter.

`override_neuron_config.lora_config` holds NxDI's own LoRA serving options for the nxd
backend (`LoraServingConfig`): adapters NxDI loads at start (`lora_ckpt_paths`),
`dynamic_multi_lora` (run-time loading, NxDI 0.9) and its eviction options. Its keys that
duplicate a vLLM flag must agree with it; keys the plugin derives are refused.

Pure: no vLLM or NxDI import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import EngineLimits, NeuronSettings

# The projections of a dense decoder layer LoRA can target, and the submodule each lives
# in (checkpoint name `model.layers.{i}.{parent}.{module}.weight`, PEFT's key
# `base_model.model.model.layers.{i}.{parent}.{module}.lora_A.weight`).
MODULE_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
TARGET_MODULES = tuple(MODULE_PARENTS)
# vLLM's packed module names (`--lora-target-modules qkv_proj`), expanded.
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# NxDI LoraServingConfig keys (modules/lora_serving/config.py, NxDI 0.7-0.9) as the
# plugin treats them in override_neuron_config.lora_config.
NXD_OPTIONS = frozenset(
    {
        "lora_ckpt_paths",
        "dynamic_multi_lora",
        "eviction_policy",
        "lfu_decay_period",
        "lora_memory_transpose",
        "lora_shard_linear_layer",
    }
)
_FROM_FLAGS = {
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "--max-cpu-loras",
    "target_modules": "--lora-target-modules",
}
_DERIVED = {
    "batch_size": "the plugin sets it to --max-num-seqs (NxDI's weight_active rows)",
    "is_context_encoding": "NxDI sets it per submodel",
    "base_model_quantized": "the plugin sets it from override_neuron_config.quantized",
    "enable_base_model_only": (
        "the plugin sets it where the installed NxDI has it (0.9), so rows without an "
        "adapter run the base model"
    ),
    "lora_ckpt_paths_cpu": (
        "adapters beyond those NxDI loads at start are added at run time through vLLM "
        "(--lora-modules, /v1/load_lora_adapter, or a request's LoRARequest)"
    ),
    "lora_ckpt_json": "list the start-up adapters in lora_ckpt_paths instead",
    "lora_bias": "adapters with biases are refused (vLLM's rule)",
}


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA part of a resolved configuration (all zero / empty when LoRA is off)."""

    max_loras: int = 0
    max_lora_rank: int = 0
    target_modules: tuple[str, ...] = ()
    max_cpu_loras: int = 0
    # override_neuron_config.lora_config, checked (nxd backend only).
    nxd_options: Mapping[str, Any] | None = None


def expand_target_modules(given: Sequence[str] | None) -> tuple[str, ...]:
    """vLLM's --lora-target-modules (None: all) as the projections they name, in layer
    order; an unknown name is refused with the known ones."""
    if not given:
        return TARGET_MODULES
    wanted: set[str] = set()
    for name in given:
        suffix = name.rsplit(".", 1)[-1]
        if suffix in PACKED_MODULES:
            wanted.update(PACKED_MODULES[suffix])
        elif suffix in MODULE_PARENTS:
            wanted.add(suffix)
        else:
            raise NeuronConfigError(
                f"--lora-target-modules {name!r} is not a projection the Neuron graphs "
                f"can carry LoRA slots for; use any of {', '.join(TARGET_MODULES)} (or "
                f"vLLM's packed qkv_proj / gate_up_proj)."
            )
    return tuple(m for m in TARGET_MODULES if m in wanted)


def resolve_lora(
    limits: EngineLimits, override: Mapping[str, Any], *, backend: str
) -> LoraSettings:
    """The LoRA settings from vLLM's --enable-lora flags (LoRA off: all zero), every
    combination that cannot work refused naming the fix."""
    options = override.get("lora_config")
    if not limits.max_loras:
        if options is not None:  # any object, {} included, turns NxDI's LoRA serving on
            raise NeuronConfigError(
                f"override_neuron_config.lora_config={options!r} is set but LoRA is off: "
                f"add --enable-lora (with --max-loras and --max-lora-rank), or remove "
                f"lora_config."
            )
        return LoraSettings()
    if limits.speculative_method:
        raise NeuronConfigError(
            f"--enable-lora with --speculative-config method {limits.speculative_method!r}: "
            f"the speculative graphs carry no adapter slots; remove one of the two."
        )
    if limits.fully_sharded_loras:
        raise NeuronConfigError(
            "--fully-sharded-loras is not supported on Neuron: the adapter slots are "
            "compiled into the graphs, where NxDI shards them itself (LoraServingConfig "
            "lora_shard_linear_layer), not vLLM's LoRA kernels; remove --fully-sharded-loras."
        )
    if limits.lora_dtype not in (None, "auto", limits.dtype):
        raise NeuronConfigError(
            f"--lora-dtype {limits.lora_dtype} differs from --dtype {limits.dtype}: the "
            f"adapter slots are compiled in the model's dtype; remove --lora-dtype or pass "
            f"--lora-dtype auto."
        )
    targets = expand_target_modules(limits.lora_target_modules)
    nxd_options = _nxd_options(options, limits, targets, backend)
    if backend == "nxd" and override.get("save_sharded_checkpoint"):
        _refuse_presharded_run_time_loading(nxd_options)
    return LoraSettings(
        max_loras=limits.max_loras,
        max_lora_rank=limits.max_lora_rank,
        target_modules=targets,
        max_cpu_loras=max(limits.max_cpu_loras, limits.max_loras),
        nxd_options=nxd_options,
    )


def _nxd_options(
    options: Any, limits: EngineLimits, targets: tuple[str, ...], backend: str
) -> dict[str, Any] | None:
    if options is None:
        return None
    key = "override_neuron_config.lora_config"
    if not isinstance(options, Mapping):
        raise NeuronConfigError(
            f"{key}={options!r} must be an object of NxDI LoraServingConfig options, e.g. "
            f'{{"lora_ckpt_paths": {{"name": "/path/to/adapter"}}}}.'
        )
    if backend != "nxd":
        raise NeuronConfigError(
            f"{key} holds NxDI's LoRA serving options, which only the nxd backend reads; "
            f"the {backend} backend loads every adapter at run time: remove lora_config "
            f"and load adapters with --lora-modules or /v1/load_lora_adapter."
        )
    flags = {
        "max_loras": limits.max_loras,
        "max_lora_rank": limits.max_lora_rank,
        "max_cpu_loras": max(limits.max_cpu_loras, limits.max_loras),
    }
    checked: dict[str, Any] = {}
    for name, value in options.items():
        if name in _DERIVED:
            raise NeuronConfigError(f"{key}.{name} is not set by hand: {_DERIVED[name]}.")
        if name == "target_modules":
            if value is not None and expand_target_modules(value) != targets:
                raise NeuronConfigError(
                    f"{key}.target_modules={value!r} contradicts --lora-target-modules "
                    f"({', '.join(targets)}); remove the key (the plugin derives it) or "
                    f"pass --lora-target-modules {' '.join(value)}."
                )
            continue
        if name in flags:
            if value != flags[name]:
                raise NeuronConfigError(
                    f"{key}.{name}={value!r} contradicts vLLM's {_FROM_FLAGS[name]} "
                    f"{flags[name]}; remove the key (the plugin derives it) or pass "
                    f"{_FROM_FLAGS[name]} {value}."
                )
            continue
        if name not in NXD_OPTIONS:
            raise NeuronConfigError(
                f"{key}.{name} is not a LoraServingConfig option the plugin passes to NxDI; "
                f"use {', '.join(sorted(NXD_OPTIONS))} (vLLM's --max-loras, "
                f"--max-lora-rank, --max-cpu-loras and --lora-target-modules set the rest)."
            )
        checked[name] = value
    checked["lora_ckpt_paths"] = _ckpt_paths(checked.get("lora_ckpt_paths"), key)
    dynamic = checked.get("dynamic_multi_lora", False)
    if not isinstance(dynamic, bool):
        raise NeuronConfigError(f"{key}.dynamic_multi_lora={dynamic!r} must be true or false.")
    policy = checked.get("eviction_policy", "lru")
    if policy not in ("lru", "lfu"):
        raise NeuronConfigError(f"{key}.eviction_policy={policy!r} must be 'lru' or 'lfu'.")
    if len(checked["lora_ckpt_paths"]) > limits.max_loras:
        raise NeuronConfigError(
            f"{key}.lora_ckpt_paths lists {len(checked['lora_ckpt_paths'])} adapters, more "
            f"than --max-loras {limits.max_loras} slots (NxDI would raise max_loras and "
            f"compile other graphs); pass --max-loras {len(checked['lora_ckpt_paths'])}."
        )
    return checked


def _refuse_presharded_run_time_loading(nxd_options: Mapping[str, Any] | None) -> None:
    """`save_sharded_checkpoint` with run-time adapter loading (NxDI 0.9's
    dynamic_multi_lora, which the plugin turns on unless lora_config says false) cannot
    work in NxDI 0.7-0.9: with no start adapters its compile stops at `assert
    len(adapter_names) > 0` (lora_checkpoint.py _shard_cpu_weights, from
    application_base.py shard_weights); with some, its pre-sharded load never builds the
    model builder, so get_cte_model() is None and every add_adapter fails in
    load_streaming_ckpt(None, ...) (application_base.py 185-197, 402-419). Without
    run-time loading the start adapters are sharded into the artifacts with the weights
    (and key them: backends/nxd/lora.py start_adapters_fingerprint)."""
    if (nxd_options or {}).get("dynamic_multi_lora") is False:
        return
    raise NeuronConfigError(
        "override_neuron_config.save_sharded_checkpoint=true with --enable-lora: NxDI's "
        "pre-sharded artifacts cannot load adapters at run time (with no "
        "lora_config.lora_ckpt_paths its compile fails on `assert len(adapter_names) > 0`, "
        "lora_checkpoint.py; with some, its pre-sharded load leaves add_adapter no model "
        "to load into). Set override_neuron_config.lora_config.dynamic_multi_lora=false to "
        "serve only the lora_ckpt_paths adapters, sharded into the compiled artifacts, or "
        "remove save_sharded_checkpoint (NxDI then shards the weights at load)."
    )


def _ckpt_paths(value: Any, key: str) -> dict[str, str]:
    """NxDI accepts a dict or a list of "name:path" (LoraServingConfig.
    convert_ckpt_paths_to_dict); the plugin keeps the dict."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(v, str) and ":" in v for v in value):
        items = [tuple(part.strip() for part in v.split(":", 1)) for v in value]
    else:
        raise NeuronConfigError(
            f"{key}.lora_ckpt_paths={value!r} must map adapter names to folders, as an "
            f'object {{"name": "/path"}} or a list ["name:/path"].'
        )
    paths: dict[str, str] = {}
    for name, path in items:
        if name in paths:
            raise NeuronConfigError(f"{key}.lora_ckpt_paths names adapter {name!r} twice.")
        paths[str(name)] = str(path)
    return paths


@dataclass(frozen=True)
class LoraGeometry:
    """What the adapter slots hold per target module: (in_features, out_features) of the
    base layer, for `num_layers` decoder layers."""

    num_layers: int
    shapes: Mapping[str, tuple[int, int]]

    @classmethod
    def from_checkpoint(
        cls, shapes: Mapping[str, Sequence[int]], num_layers: int, targets: Sequence[str]
    ) -> LoraGeometry:
        """From the checkpoint's tensor shapes (safetensors headers); a target module the
        checkpoint's layers lack (a mixture-of-experts MLP) is refused."""
        found: dict[str, tuple[int, int]] = {}
        for module in targets:
            name = f"model.layers.0.{MODULE_PARENTS[module]}.{module}.weight"
            if name not in shapes:
                raise NeuronConfigError(
                    f"--lora-target-modules includes {module}, but the checkpoint has no "
                    f"{name} (its layers have no dense {module}, e.g. a mixture-of-experts "
                    f"MLP); pass --lora-target-modules with the attention projections "
                    f"(q_proj k_proj v_proj o_proj)."
                )
            out_features, in_features = shapes[name]
            found[module] = (int(in_features), int(out_features))
        return cls(num_layers, found)

    def slot_bytes(self, rank: int, itemsize: int = 4) -> int:
        """One adapter's A and B tensors over every layer and module at `rank`."""
        per_layer = sum(rank * (i + o) for i, o in self.shapes.values())
        return self.num_layers * per_layer * itemsize


def lora_summary(settings: NeuronSettings) -> str | None:
    """What LoRA serving does with these settings (the start-up log line)."""
    if not settings.max_loras:
        return None
    return (
        f"multi-LoRA: {settings.max_loras} adapter slots of rank {settings.max_lora_rank} "
        f"compiled in for {', '.join(settings.lora_target_modules)} (slot 0 serves rows "
        f"without an adapter); up to {settings.max_cpu_loras} adapters held on the host, "
        f"written into a slot (least recently used first) when a step needs them"
    )
