"""How `neuron-plugin explain-config` prints its report for people (the same report as
`--json`, built by `tools/explain.py`)."""

from __future__ import annotations

from typing import Any

from neuron_plugin.core.instances import format_core_list
from neuron_plugin.core.memory import GIB


def _speculation_line(spec: dict[str, Any], mem: dict[str, Any]) -> str:
    line = (
        f"{spec['method']}, {spec['num_speculative_tokens']} drafts a step: every "
        f"token-generation graph computes {spec['speculation_length']} positions a row "
        f"(NxDI speculation_length {spec['speculation_length']}, enable_fused_speculation "
        f"{str(spec['enable_fused_speculation']).lower()}"
        + (
            f", enable_eagle_speculation true, is_eagle3 {str(spec['is_eagle3']).lower()}"
            if spec.get("enable_eagle_speculation")
            else ""
        )
        + ")"
    )
    if spec["draft_model"]:
        kind = "head" if spec.get("enable_eagle_speculation") else "draft"
        line += (
            f"; {kind} {spec['draft_model']}: weights "
            f"{human_size(mem['draft_weights_per_core_bytes'])} + KV cache "
            f"{human_size(mem['draft_kv_cache_per_core_bytes'])} per NeuronCore"
        )
        if mem["eagle_hidden_states_per_core_bytes"]:
            line += (
                f", and the hidden states it reads "
                f"{human_size(mem['eagle_hidden_states_per_core_bytes'])}"
            )
    return line


def human_size(value: int | None) -> str:
    if value is None:
        return "unknown"
    if value >= GIB:
        return f"{value / GIB:.2f} GiB"
    if value >= 1 << 20:
        return f"{value / (1 << 20):.1f} MiB"
    return f"{value / 1024:.1f} KiB"


def _blocks_line(kv: dict[str, Any], settings: dict[str, Any]) -> str:
    if kv["layout"] == "contiguous":
        return (
            f"{kv['num_blocks']} vLLM blocks of {kv['block_size']} tokens: one per "
            f"sequence slot plus vLLM's null block; NxDI holds "
            f"{settings['max_num_seqs']} x {settings['max_model_len']} positions"
        )
    return (
        f"{kv['num_blocks']} of {kv['block_size']} tokens including vLLM's null block "
        f"({kv['usable_blocks']} usable) = NxDI pa_num_blocks"
    )


def _engines_line(dp: dict[str, Any]) -> str:
    cores = ", ".join(
        f"{rank}: {format_core_list(ids)}" for rank, ids in enumerate(dp["engine_cores"])
    )
    return (
        f"{dp['engines']} (data-parallel rank -> NEURON_RT_VISIBLE_CORES: {cores}; "
        f"from {dp['source']})"
    )


def _support_lines(support: dict[str, str] | None, release: str | None) -> list[str]:
    if not support:
        return []
    states = ", ".join(f"{feature} {state.split()[0]}" for feature, state in support.items())
    return [
        f"NxDI release     {release}",
        f"on real NxDI     {states} (docs/serving/architectures.md)",
    ]


def _graph_counts(graphs: dict[str, int]) -> str:
    kinds = (
        ("context_encoding", "context encoding"),
        ("token_generation", "token generation"),
        ("token_generation_logits", "token generation with logits"),
        ("vision_encoding", "vision encoder"),
    )
    return ", ".join(
        f"{graphs[key]} {name}"
        for key, name in kinds
        if graphs[key] or key in ("context_encoding", "token_generation")
    )


def render(report: dict[str, Any]) -> str:
    """The report for people."""
    kv, buckets, graphs, mem = (
        report["kv_layout"],
        report["buckets"],
        report["graphs"],
        report["memory"],
    )
    lines = [
        f"model            {report['model']} ({report['architecture']})",
        f"backend          {report['backend']}"
        + (f" -> {report['nxdi_model']}" if report["nxdi_model"] else ""),
        *_support_lines(report["nxdi_support"], report["nxdi_release"]),
        f"KV layout        {kv['layout']} ({kv['reason']})",
        f"blocks           {_blocks_line(kv, report['settings'])}",
        f"capacity         {kv['capacity']}",
        f"context buckets  {buckets['context_encoding']}"
        + (f" x prefix {buckets['prefix']}" if buckets["prefix"] else ""),
        f"decode buckets   {buckets['token_generation']} x batches "
        f"{buckets['token_generation_batches']}",
        f"decode batches   {report['decode_batches']['summary']}",
        *([f"vision buckets   {buckets['vision']} patches per image"] if buckets["vision"] else []),
        f"graphs           {graphs['total']} ({_graph_counts(graphs)})",
        f"memory/core      weights {human_size(mem['weights_per_core_bytes'])} + KV cache "
        f"{human_size(mem['kv_cache_per_core_bytes'])}"
        + (
            f" + state {human_size(mem['state_per_core_bytes'])}"
            if mem.get("state_per_core_bytes")
            else ""
        )
        + " of "
        f"{human_size(mem['device_memory_per_core_bytes'])} HBM per NeuronCore of "
        f"{mem['instance_type']} ({mem['instance_source']}); TP {mem['tp_degree']} of "
        f"{mem['instance_cores']} cores",
        f"KV heads/core    {mem['kv_heads']['summary']}; "
        f"{human_size(mem['kv_bytes_per_token_per_core'])} of KV per token per NeuronCore",
        *(
            [
                f"state/core       {report['state']['summary']}; "
                f"{human_size(mem['state_per_core_bytes'])} for "
                f"{report['state']['sequences']} at once"
            ]
            if report.get("state")
            else []
        ),
        f"engines          {_engines_line(report['data_parallel'])}",
    ]
    if mem.get("unquantized_weights_per_core_bytes"):
        quantization = report["settings"]["passthrough"]
        lines.append(
            f"quantized        {quantization.get('quantization_dtype') or 'int8'} "
            f"{quantization.get('quantization_type') or 'per_tensor_symmetric'} from "
            f"{quantization.get('quantized_checkpoints_path')}: weights "
            f"{human_size(mem['weights_per_core_bytes'])} instead of "
            f"{human_size(mem['unquantized_weights_per_core_bytes'])} per NeuronCore, saving "
            f"{human_size(mem['quantization_saves_per_core_bytes'])}"
        )
    if report["lora"]:
        lora = report["lora"]
        lines.append(
            f"LoRA             {lora['max_loras']} adapter slots (+ the base model's) of "
            f"rank {lora['max_lora_rank']} for {', '.join(lora['target_modules'])}: "
            f"{human_size(lora['slots_per_core_bytes'])} per NeuronCore; up to "
            f"{lora['max_cpu_loras']} adapters on the host"
        )
    if report["speculation"]:
        lines.append(f"speculation      {_speculation_line(report['speculation'], mem)}")
    if report["speculation"]:
        lines.append(f"note: {report['speculation']['summary']}")
    lines += [f"warning: {w}" for w in report["warnings"]]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)
