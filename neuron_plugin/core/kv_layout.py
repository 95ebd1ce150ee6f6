"""The KV cache's layout (contiguous or block) and its block size and count."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import BLOCK, CONTIGUOUS, EngineLimits
from neuron_plugin.core.override_checks import bool_setting, int_setting

DEFAULT_BLOCK_SIZE = 32


def resolve_kv_layout(limits: EngineLimits, override: Mapping[str, Any]) -> tuple[str, str]:
    """Contiguous unless prefix caching or chunked prefill needs blocks (the findings:
    block layout costs latency, so it is used only when a feature requires it)."""
    block_kv = bool_setting(override, "is_block_kv_layout")
    for key, vllm_name, value in (
        ("is_prefix_caching", "enable_prefix_caching", limits.enable_prefix_caching),
        ("is_chunked_prefill", "enable_chunked_prefill", limits.enable_chunked_prefill),
    ):
        given = bool_setting(override, key)
        if given is not None and given != value:
            flag = f"--{'' if given else 'no-'}{vllm_name.replace('_', '-')}"
            raise NeuronConfigError(
                f"override_neuron_config.{key}={given} contradicts vLLM's "
                f"{vllm_name}={value}; pass {flag} or remove {key}."
            )
    needs_blocks = [
        name
        for name, on in (
            ("prefix caching", limits.enable_prefix_caching),
            ("chunked prefill", limits.enable_chunked_prefill),
        )
        if on
    ]
    if needs_blocks:
        if block_kv is False:
            raise NeuronConfigError(
                f"override_neuron_config.is_block_kv_layout=false cannot serve "
                f"{' and '.join(needs_blocks)}, which reads the KV cache through block "
                f"tables; remove is_block_kv_layout or disable "
                f"{' and '.join(needs_blocks)}."
            )
        return BLOCK, f"{' and '.join(needs_blocks)} on"
    if block_kv:
        return BLOCK, "override_neuron_config.is_block_kv_layout=true"
    return CONTIGUOUS, "prefix caching and chunked prefill off"


def required_blocks(
    max_num_seqs: int, max_model_len: int, block_size: int, state_blocks: int = 0
) -> int:
    """Blocks for `max_num_seqs` full-length sequences plus vLLM's null block
    (true ceiling division: a partial last block is still a block); a hybrid model's
    sequence also holds `state_blocks` blocks of state (`state_blocks_per_seq`)."""
    return max_num_seqs * (math.ceil(max_model_len / block_size) + state_blocks) + 1


def state_blocks_per_seq(limits: EngineLimits, kv_layout: str) -> int:
    """The state blocks one sequence of a hybrid model holds in the block layout (none in
    the contiguous one: its state slot is its sequence slot): one per state group, two
    with prefix caching (vLLM's 'align' mode keeps the previous block's state while the
    next one is written, MambaSpec.max_memory_usage_bytes)."""
    if limits.state is None or kv_layout == CONTIGUOUS:
        return 0
    return limits.state.groups() * (2 if limits.enable_prefix_caching else 1)


def resolve_blocks(
    limits: EngineLimits, override: Mapping[str, Any], kv_layout: str
) -> tuple[int, int]:
    """(block_size, num_blocks including the null block) for the chosen layout."""
    pa_block_size = int_setting(override, "pa_block_size")
    pa_num_blocks = int_setting(override, "pa_num_blocks")
    if kv_layout == CONTIGUOUS:
        for key in ("pa_block_size", "pa_num_blocks"):
            if key in override:
                raise NeuronConfigError(
                    f"override_neuron_config.{key} applies to the block KV layout, but "
                    f"the layout is contiguous (prefix caching and chunked prefill off); "
                    f"remove {key} or enable --enable-prefix-caching."
                )
        # One vLLM block per sequence (block_size = max_model_len) and one per slot.
        return limits.max_model_len, limits.max_num_seqs + 1

    block_size = limits.block_size or DEFAULT_BLOCK_SIZE
    if pa_block_size is not None and pa_block_size != block_size:
        raise NeuronConfigError(
            f"override_neuron_config.pa_block_size={pa_block_size} differs from vLLM's "
            f"block_size={block_size}; pass --block-size {pa_block_size} or remove "
            f"pa_block_size (it follows --block-size)."
        )
    override_blocks = limits.num_gpu_blocks_override
    if (
        pa_num_blocks is not None
        and override_blocks is not None
        and pa_num_blocks != override_blocks
    ):
        raise NeuronConfigError(
            f"override_neuron_config.pa_num_blocks={pa_num_blocks} differs from vLLM's "
            f"num_gpu_blocks_override={override_blocks}; both count the same blocks "
            f"(including vLLM's null block), so set one of them."
        )
    state_blocks = state_blocks_per_seq(limits, kv_layout)
    needed = required_blocks(limits.max_num_seqs, limits.max_model_len, block_size, state_blocks)
    given = pa_num_blocks if pa_num_blocks is not None else override_blocks
    if given is None:
        return block_size, needed
    if given < needed:
        per_seq = math.ceil(limits.max_model_len / block_size)
        name = "pa_num_blocks" if pa_num_blocks is not None else "num_gpu_blocks_override"
        state = f" + {state_blocks} state blocks" if state_blocks else ""
        raise NeuronConfigError(
            f"{name}={given} is too small: max_num_seqs={limits.max_num_seqs} sequences "
            f"of max_model_len={limits.max_model_len} tokens need "
            f"{limits.max_num_seqs} x (ceil({limits.max_model_len}/{block_size}){state})="
            f"{limits.max_num_seqs * (per_seq + state_blocks)} blocks plus vLLM's null "
            f"block = {needed}; set {name} >= {needed} or lower max_num_seqs / "
            f"max_model_len."
        )
    return block_size, given
