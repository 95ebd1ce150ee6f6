"""`neuron-plugin explain-config`: what a configuration would compile and serve, without
compiling anything.

It takes the flags of `vllm serve` (vLLM's own argument parser), builds the VllmConfig as
`vllm serve` would, lets the Neuron platform resolve its settings, and reports the KV
layout and why, block counts, every bucket grid, the number of graphs, which NeuronCores
each data-parallel engine takes, device memory per NeuronCore for weights and KV cache
against the instance's HBM, and warnings for
combinations the field measurements show to be slow. `--json` prints the same report as
one JSON object (schema in docs/reference/neuron-plugin.md); without it,
`explain_render.render` prints it for people.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from neuron_plugin import BACKEND_ENV, BACKENDS
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    InstanceType,
    core_slices,
    detect_instance_type,
    host_visible_cores,
    lnc,
)
from neuron_plugin.core.kv_heads import model_head_sharding
from neuron_plugin.core.memory import (
    GIB,
    USABLE_FRACTION,
    MemoryEstimate,
    checkpoint_parameters,
    estimate,
)
from neuron_plugin.core.settings import MAX_NUM_SEQS_CHOSEN, NeuronConfigError, NeuronSettings
from neuron_plugin.tools.explain_render import human_size, render
from neuron_plugin.tools.serve_args import add_serve_command, engine_config_from_serve_args

DEFAULT_INSTANCE = "inf2.xlarge"
BUCKETING_OFF_EVIDENCE = (
    "bucketing off compiles one graph of the full length, so a short prompt pays for "
    "all of it: a 94-token prompt measured 211 ms in the 2048 graph vs 13.4 ms in the "
    "128 bucket on inf2 (15.8x)"
)
CHUNKED_EVIDENCE = (
    "chunked prefill needs the block KV layout, whose graphs measured 40-45% slower "
    "than the contiguous layout on inf2"
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_serve_command(
        subparsers,
        "explain-config",
        run,
        _own_options,
        "show the resolved Neuron settings, buckets, graphs and memory for a model "
        "and `vllm serve` flags, without compiling",
    )


def _own_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("explain-config")
    group.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object (see docs/reference/neuron-plugin.md)",
    )
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"backend to resolve for (default: ${BACKEND_ENV}, else what "
        f"`vllm serve` with these flags would use, else nxd)",
    )
    group.add_argument(
        "--instance-type",
        choices=sorted(INSTANCE_TYPES),
        help=f"instance to size memory against (default: this host's, else {DEFAULT_INSTANCE})",
    )


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Any]:
    """Our options plus `vllm serve`'s flags -> (options, VllmConfig)."""
    # The report owns stdout (--json is read by programs); vLLM's log lines go to stderr.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return engine_config_from_serve_args(argv, _own_options, prog="neuron-plugin explain-config")


def choose_instance(requested: str | None) -> tuple[InstanceType, str]:
    if requested:
        return INSTANCE_TYPES[requested], "--instance-type"
    detected = detect_instance_type()
    if detected:
        return INSTANCE_TYPES[detected], "this host"
    return INSTANCE_TYPES[DEFAULT_INSTANCE], "assumed (not an EC2 Neuron host)"


def nxdi_model(settings: NeuronSettings, release: nxdi_releases.NxDIRelease) -> str | None:
    """The class the nxd backend would build with `release` (the architecture table's,
    or an entry point's)."""
    if settings.backend != "nxd":
        return None
    from neuron_plugin.backends.nxd.models import describe_architecture
    from neuron_plugin.models.third_party import entry_points

    return describe_architecture(settings.architecture, entry_points(), release)


def engine_cores(
    settings: NeuronSettings, instance: InstanceType, instance_source: str, host_source: str
) -> tuple[list[list[int]], str]:
    """(each data-parallel engine's NeuronCores, where the cores come from): the slices
    the settings resolved on this host, else the instance's cores split the same way
    (refused, with the arithmetic, when TP x DP does not fit)."""
    if settings.rank_cores:
        return [list(cores) for cores in settings.rank_cores], host_source
    cores = instance.cores(lnc())
    source = f"the {cores} cores of {instance.name}, {instance_source}"
    return core_slices(settings.tp_degree, settings.dp_degree, range(cores), source), source


def warnings_for(
    settings: NeuronSettings, memory: MemoryEstimate, instance: InstanceType
) -> list[str]:
    """Known slow or failing combinations, each with the measurement or the fix."""
    from neuron_plugin.platform import PREFIX_CACHING_EVIDENCE

    found = []
    if settings.is_prefix_caching and settings.enable_bucketing:
        found.append(
            f"prefix caching with bucketing: {PREFIX_CACHING_EVIDENCE}; pass "
            f"--no-enable-prefix-caching unless prompts share long prefixes."
        )
    if settings.is_chunked_prefill:
        found.append(
            f"{CHUNKED_EVIDENCE}; pass --no-enable-chunked-prefill to encode whole prompts."
        )
    if not settings.enable_bucketing:
        found.append(f"{BUCKETING_OFF_EVIDENCE}; remove enable_bucketing=false.")
    total, fraction = memory.total_per_core_bytes, memory.fraction_of_core_memory
    if total is not None and fraction is not None and fraction > USABLE_FRACTION:
        found.append(
            f"weights and KV cache need {total / GIB:.1f} GiB per "
            f"NeuronCore, {fraction:.0%} of the {memory.device_memory_per_core_bytes / GIB:.0f}"
            f" GiB a core of {instance.name} has, before graphs and scratchpad; raise "
            f"--tensor-parallel-size or lower --max-num-seqs / --max-model-len."
        )
    return found


def decode_batches_report(settings: NeuronSettings) -> dict[str, Any]:
    """The decode batch sizes, why there is one where there is, and what the others
    cost: one token-generation graph per size and length, each compiled (the compile
    time of the token-generation graphs grows with their count)."""
    sizes = list(settings.token_generation_batches)
    lengths = len(settings.token_generation_buckets)
    graphs = len(settings.token_generation_shapes())
    added = graphs - lengths
    total = settings.graph_count()
    if settings.token_generation_batches_reason:
        summary = (
            f"one decode batch size, max_num_seqs={settings.max_num_seqs}: every decode step "
            f"computes {settings.max_num_seqs} rows ({settings.token_generation_batches_reason})"
        )
    elif len(sizes) == 1:
        summary = f"one decode batch size: every decode step computes {sizes[0]} rows"
    else:
        summary = (
            f"{len(sizes)} decode batch sizes {sizes}: a decode step computes the first that "
            f"holds its rows; they add {added} token-generation graphs to the "
            f"{total - added} one batch size would compile ({total} in all, x"
            f"{total / (total - added):.2f} the graphs and their compile time); "
            f"override_neuron_config max_batch_buckets bounds them (1: one size)"
        )
    return {
        "sizes": sizes,
        "reason": settings.token_generation_batches_reason or None,
        "graphs_added": added,
        "summary": summary,
    }


def notes_for(settings: NeuronSettings, host_cores: int | None, host_source: str) -> list[str]:
    notes = []
    if settings.max_num_seqs_reason != MAX_NUM_SEQS_CHOSEN:
        notes.append(f"max_num_seqs={settings.max_num_seqs}: {settings.max_num_seqs_reason}.")
    if settings.backend == "nxd" and host_cores is None:
        notes.append(
            f"this host cannot run the nxd backend ({host_source}); the report "
            f"is computed without compiling."
        )
    if settings.on_device_sampling:
        notes.append(
            "on-device sampling serves requests that use only temperature, top_k and "
            "top_p; others are sampled on the host. "
            + (
                "A top_k of 0 or above global_topk is sampled on the host too (exact_sampling)."
                if settings.exact_sampling
                else f"A top_k of 0 or above global_topk samples from the "
                f"{settings.global_topk} most likely tokens (exact_sampling=true: on the "
                f"host, over the whole vocabulary)."
            )
        )
    return notes


def logits_traffic(settings: NeuronSettings, hf_config: dict) -> dict[str, int | None]:
    """Bytes of float32 logits the graphs of each kind return per call (NxDI casts the
    logits to float32, models/model_base.py NeuronBaseModel.forward): null for a kind
    that returns none. `vocab_size` null: unknown."""
    vocab = hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size")
    if not vocab:
        return {"vocab_size": None, "prefill": None, "decode": None, "decode_with_host_rows": None}
    row = 4 * int(vocab)
    # n-gram speculation's graphs return every position's logits (speculation_length)
    full = row * settings.max_num_seqs * max(1, settings.speculation_length)
    if not settings.on_device_sampling:
        return {"vocab_size": vocab, "prefill": row, "decode": full, "decode_with_host_rows": full}
    split = bool(settings.token_generation_logits_shapes())
    return {
        "vocab_size": vocab,
        "prefill": row,
        "decode": None if split else full,
        "decode_with_host_rows": full,
    }


def logits_notes(settings: NeuronSettings, hf_config: dict) -> list[str]:
    """What the token-generation logits graphs cost and buy (nxd, on-device sampling)."""
    shapes = settings.token_generation_logits_shapes()
    if not shapes:
        return []
    traffic = logits_traffic(settings, hf_config)
    full = traffic["decode_with_host_rows"]
    size = f" ({human_size(full)} of float32 logits)" if full else ""
    others = settings.graph_count() - len(shapes)
    lengths = [n for _, n in shapes]
    if tuple(lengths) == settings.token_generation_buckets:
        where = "at the same context length"
    elif len(lengths) == 1:
        where = (
            f"at the largest context length, {lengths[0]}, whatever its rows' lengths "
            f"(token_generation_logits_buckets adds twins at shorter lengths)"
        )
    else:
        where = f"at the first of the lengths {lengths} that fits (token_generation_logits_buckets)"
    count = f"{len(shapes)} logits graphs add" if len(shapes) > 1 else "logits graph adds"
    notes = [
        f"a decode step whose rows are all sampled on the device runs a token-generation "
        f"graph that returns tokens alone; a step with a host-sampled row (logprobs, "
        f"penalties, grammar, seed, ...) runs its logits twin {where} and the full batch "
        f"of {settings.max_num_seqs}, which returns every row's logits{size}; a prefill "
        f"returns its one row. The {count} {len(shapes) / others:.0%} to the {others} "
        f"other graphs to compile and cache (compiled once, with them)."
    ]
    return notes + ([f"{settings.logits_buckets_note}."] if settings.logits_buckets_note else [])


def build_report(
    settings: NeuronSettings,
    model: str,
    hf_config: dict,
    parameters: int | None,
    instance: InstanceType,
    instance_source: str,
    host: tuple[int | None, str],
) -> dict[str, Any]:
    """The explain-config report (the --json schema)."""
    cores = instance.cores(lnc())
    ranks, ranks_source = engine_cores(settings, instance, instance_source, host[1])
    memory = estimate(
        settings,
        hf_config,
        parameters,
        instance.memory_per_core(lnc()),
        draft_of(settings),
        quantized_of(settings, model),
    )
    cte = [list(shape) for shape in settings.context_encoding_shapes()]
    tkg = [list(shape) for shape in settings.token_generation_shapes()]
    tkg_logits = [list(shape) for shape in settings.token_generation_logits_shapes()]
    family = nxdi_releases.for_family(instance.chip.target)
    try:
        model_class, problems = nxdi_model(settings, family), []
    except NeuronConfigError as exc:
        model_class, problems = None, [str(exc)]
    support, release = None, None
    if settings.backend == "nxd":
        from neuron_plugin.backends.nxd import compat

        support, refused = compat.explain(settings, hf_config, os.environ, family)
        problems += refused
        release = f"{family.describe()}, the release {instance.name} runs"
    return {
        "model": model,
        "architecture": settings.architecture,
        "backend": settings.backend,
        "nxdi_model": model_class,
        "nxdi_support": support,
        "nxdi_release": release,
        "kv_layout": {
            "layout": settings.kv_layout,
            "reason": settings.kv_layout_reason,
            "block_size": settings.block_size,
            "num_blocks": settings.num_blocks,
            "null_blocks": 1,
            "usable_blocks": settings.num_blocks - 1,
            "max_blocks_per_seq": settings.max_blocks_per_seq,
            "capacity": settings.capacity(),
        },
        "buckets": {
            "context_encoding": list(settings.context_encoding_buckets),
            "prefix": list(settings.prefix_buckets),
            "token_generation": list(settings.token_generation_buckets),
            "token_generation_batches": list(settings.token_generation_batches),
            "context_encoding_shapes": cte,
            "token_generation_shapes": tkg,
            "token_generation_logits_shapes": tkg_logits,
            "vision": list(settings.vision_buckets),
        },
        "decode_batches": decode_batches_report(settings),
        "graphs": {
            "context_encoding": len(cte),
            "token_generation": len(tkg),
            "token_generation_logits": len(tkg_logits),
            "vision_encoding": len(settings.vision_shapes()),
            "total": settings.graph_count(),
        },
        "logits": logits_traffic(settings, hf_config),
        "memory": {
            "instance_type": instance.name,
            "instance_source": instance_source,
            "tp_degree": settings.tp_degree,
            "instance_cores": cores,
            "kv_heads": kv_heads_report(hf_config, settings.tp_degree),
            **memory.to_dict(),
        },
        "state": state_report(settings, hf_config, memory),
        "speculation": speculation_report(settings),
        "lora": lora_report(settings, model),
        "data_parallel": {
            "engines": settings.dp_degree,
            "engine_cores": ranks,
            "source": ranks_source,
        },
        "host": {"visible_cores": host[0], "source": host[1]},
        "warnings": problems + warnings_for(settings, memory, instance),
        "notes": notes_for(settings, *host) + logits_notes(settings, hf_config),
        "settings": settings.to_dict(),
    }


def state_report(
    settings: NeuronSettings, hf_config: dict, memory: MemoryEstimate
) -> dict[str, Any] | None:
    """A hybrid model's state layers (core.recurrent_state): which layers keep a state
    instead of a KV cache, what one sequence's state takes, where vLLM keeps it (None for
    a model without state layers)."""
    from neuron_plugin.core.memory import state_sequences
    from neuron_plugin.core.recurrent_state import state_geometry

    geometry = state_geometry(hf_config)
    if geometry is None:
        return None
    block = settings.is_block_layout
    return {
        "layers": list(geometry.layers),
        "attention_layers": list(geometry.attention_layers),
        "conv_shape": list(geometry.conv_shape),
        "recurrent_shape": list(geometry.recurrent_shape),
        "bytes_per_sequence_per_core": memory.state_bytes_per_sequence_per_core,
        "sequences": state_sequences(settings),
        "per_core_bytes": memory.state_per_core_bytes,
        "groups": settings.state_groups if block else None,
        "block_size": settings.state_block_size if block else None,
        "mamba_cache_mode": ("align" if settings.is_prefix_caching else "none") if block else None,
        "summary": (
            f"{len(geometry.layers)} of {geometry.num_layers} layers keep a state instead "
            f"of a KV cache, {human_size(memory.state_bytes_per_sequence_per_core)} a "
            f"sequence per NeuronCore whatever its length; "
            + (
                f"in vLLM's hybrid KV cache, the state layers in {settings.state_groups} "
                f"groups: a state block per group and sequence"
                + (
                    f", at every {settings.state_block_size} positions with prefix caching "
                    f"('align': the last full block's kept while the next is written)"
                    if settings.is_prefix_caching
                    else " ('none')"
                )
                if block
                else "a state slot per sequence slot, beside its KV cache line"
            )
        ),
    }


def kv_heads_report(hf_config: dict, tp_degree: int) -> dict[str, Any]:
    """The model's heads as NxDI shards them over the TP ranks (core.kv_heads)."""
    sharding = model_head_sharding(hf_config, tp_degree)
    return {
        "attention_heads": sharding.attention_heads,
        "kv_heads": sharding.kv_heads,
        "strategy": sharding.strategy,
        "padded_attention_heads": sharding.padded_attention_heads,
        "padded_kv_heads": sharding.padded_kv_heads,
        "kv_heads_per_core": sharding.kv_heads_per_core,
        "summary": sharding.describe(),
    }


def quantized_of(settings: NeuronSettings, model: str) -> tuple[int, int] | None:
    """(weights unquantized, quantized) of the whole model, for the memory estimate."""
    quantization = settings.quantization
    if quantization is None or not Path(model).is_dir():
        return None
    from neuron_plugin.core.checkpoint import safetensors_shapes
    from neuron_plugin.core.memory import DTYPE_BYTES
    from neuron_plugin.core.quantization import quantized_weight_bytes

    return quantized_weight_bytes(
        safetensors_shapes(model), quantization, DTYPE_BYTES[settings.dtype]
    )


def lora_report(settings: NeuronSettings, model: str) -> dict[str, Any] | None:
    """The adapter slots compiled in and their device memory per core."""
    if not settings.max_loras:
        return None
    from neuron_plugin.core.checkpoint import read_hf_config, safetensors_shapes, text_config
    from neuron_plugin.core.lora import LoraGeometry
    from neuron_plugin.core.memory import DTYPE_BYTES

    report: dict[str, Any] = {
        "max_loras": settings.max_loras,
        "slots": settings.lora_slots,
        "max_lora_rank": settings.max_lora_rank,
        "target_modules": list(settings.lora_target_modules),
        "max_cpu_loras": settings.max_cpu_loras,
        "slots_per_core_bytes": None,
    }
    if Path(model).is_dir():
        geometry = LoraGeometry.from_checkpoint(
            safetensors_shapes(model),
            int(text_config(read_hf_config(model))["num_hidden_layers"]),
            settings.lora_target_modules,
        )
        per_slot = geometry.slot_bytes(settings.max_lora_rank, DTYPE_BYTES[settings.dtype])
        report["slots_per_core_bytes"] = -(-per_slot * settings.lora_slots // settings.tp_degree)
    return report


def draft_of(settings: NeuronSettings) -> tuple[dict[str, Any], int | None] | None:
    """A fused draft model's (or EAGLE head's) config and parameter count, for the
    memory estimate."""
    if not settings.draft_model:
        return None
    from neuron_plugin.core.checkpoint import read_hf_config

    return read_hf_config(settings.draft_model), checkpoint_parameters(settings.draft_model)


def speculation_report(settings: NeuronSettings) -> dict[str, Any] | None:
    """What speculative decoding compiles (None without it)."""
    if not settings.speculation_method:
        return None
    from neuron_plugin.core.neuron_settings import EAGLE3
    from neuron_plugin.core.speculation import speculation_summary

    return {
        "method": settings.speculation_method,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "draft_model": settings.draft_model,
        # NxDI's keys (nxd backend); the reference backend compiles the same graphs.
        "speculation_length": settings.speculation_length,
        "enable_fused_speculation": settings.is_fused_speculation,
        "enable_eagle_speculation": settings.is_eagle,
        "is_eagle3": settings.speculation_method == EAGLE3,
        "summary": speculation_summary(
            settings.speculation_method, settings.num_speculative_tokens, settings.backend
        ),
    }


def explain(argv: Sequence[str]) -> tuple[dict[str, Any], bool]:
    """(report, whether --json was asked for) for `vllm serve`-style arguments."""
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    options, vllm_config = parse(argv)
    settings = settings_from_vllm_config(vllm_config)
    model = vllm_config.model_config.model
    instance, source = choose_instance(options.instance_type)
    parameters = checkpoint_parameters(model) if Path(model).is_dir() else None
    report = build_report(
        settings,
        model,
        vllm_config.model_config.hf_config.to_dict(),
        parameters,
        instance,
        source,
        host_visible_cores(),
    )
    return report, options.json


def run(args: argparse.Namespace) -> int:
    report, as_json = explain(args.argv)
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0
