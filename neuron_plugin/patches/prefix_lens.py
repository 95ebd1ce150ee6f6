"""Patch `adapter-prefix-lens`: direct NxDI generation with prefix caching.

With `is_prefix_caching=True` NxDI's forward computes `full_context_lens -
computed_context_lens` and reads the block KV cache through `slot_mapping` and
`block_table`; `HuggingFaceGenerationAdapter.prepare_inputs_for_generation` passes none
of them, so `generate()` fails with "unsupported operand type(s) for -: 'NoneType' and
'NoneType'" (NxDI 0.7 to 0.9). vLLM's path is unaffected because the plugin builds these
from the scheduler state. The fix derives them from the attention mask and whether the
KV cache is populated, with a fixed allocation of blocks per row (row b owns blocks
[b * blocks_per_row, (b + 1) * blocks_per_row)), as NxDI's own chunked-prefill test
helper does. Because that path never marks the KV cache populated, the fix also extends
the attention mask over the generated tokens, so each step re-encodes the sequence so
far (correct, if slower than decoding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from neuron_plugin.patches.base import NxDIModules, Patch, replace_method, unpatched

NAME = "adapter-prefix-lens"


def prefix_cache_inputs(
    attention_mask: Any, decoding: bool, *, block_size: int, seq_len: int, num_blocks: int
) -> dict[str, Any]:
    """NxD contract arrays for one adapter step: full/computed context lengths
    [batch, 1], a block table [batch, active blocks] and the slot of every input token
    (-1 for padding). `attention_mask` covers every token so far, this step's included."""
    import torch

    mask = attention_mask.long()
    batch = mask.shape[0]
    per_row = math.ceil(seq_len / block_size)
    if batch * per_row > num_blocks:
        raise ValueError(
            f"pa_num_blocks={num_blocks} is too small for {batch} sequence(s) of "
            f"seq_len={seq_len} in blocks of pa_block_size={block_size} "
            f"({batch} x {per_row} = {batch * per_row} blocks); raise pa_num_blocks or "
            f"generate fewer sequences at once."
        )
    full = mask.sum(dim=-1, keepdim=True)
    computed = full - 1 if decoding else torch.zeros_like(full)
    table = torch.arange(batch * per_row, dtype=torch.long).reshape(batch, per_row)
    table = table[:, : max(1, math.ceil(int(full.max()) / block_size))]
    if decoding:
        positions, real = full - 1, torch.ones_like(full, dtype=torch.bool)
    else:
        positions, real = mask.cumsum(dim=-1) - 1, mask.bool()
    positions = positions.clamp(min=0)
    blocks = torch.gather(table, 1, (positions // block_size).clamp(max=table.shape[1] - 1))
    slots = torch.where(
        real, blocks * block_size + positions % block_size, torch.full_like(positions, -1)
    )
    return {
        "full_context_lens": full,
        "computed_context_lens": computed,
        "block_table": table,
        "slot_mapping": slots,
    }


def _stand_in_adapter() -> SimpleNamespace:
    """The attributes prepare_inputs_for_generation reads, for a prefill step of a
    prefix-caching configuration (a fixed adapter may read any of them)."""
    return SimpleNamespace(
        neuron_model=SimpleNamespace(kv_cache_populated=False, get_required_kwargs=list),
        neuron_config=SimpleNamespace(
            is_prefix_caching=True,
            is_block_kv_layout=True,
            seq_len=8,
            pa_block_size=4,
            pa_num_blocks=4,
            padding_side="right",
            tensor_replacement_config=None,
            on_device_sampling_config=None,
            lora_config=None,
            speculation_length=0,
        ),
        input_start_offsets=None,
        prev_kv_cache_populated=False,
    )


def probe(modules: NxDIModules) -> str | None:
    import torch

    prepare = unpatched(
        modules.hf_adapter.HuggingFaceGenerationAdapter.prepare_inputs_for_generation
    )
    ids = torch.tensor([[11, 12, 13]])
    try:
        inputs = prepare(_stand_in_adapter(), ids, attention_mask=torch.ones_like(ids))
    except Exception as exc:  # the probe input is valid; any failure means "defective"
        return (
            f"prepare_inputs_for_generation fails on a prefix-caching prefill "
            f"({type(exc).__name__}: {exc})"
        )
    if inputs.get("full_context_lens") is None or inputs.get("computed_context_lens") is None:
        return (
            "with is_prefix_caching the adapter passes no full_context_lens / "
            "computed_context_lens (forward fails: NoneType - NoneType)"
        )
    return None


def _cover_generated(input_ids: Any, attention_mask: Any) -> Any:
    """The attention mask extended by ones over tokens generated after it. NxDI's
    prefix-caching path never marks the KV cache populated, so the adapter neither
    trims the inputs to the last token nor extends the mask: each step re-encodes the
    whole sequence, which is correct once the mask covers it."""
    import torch

    missing = input_ids.shape[1] - attention_mask.shape[1]
    if missing <= 0:
        return attention_mask
    return torch.cat(
        [attention_mask, attention_mask.new_ones((attention_mask.shape[0], missing))], dim=-1
    )


def apply(modules: NxDIModules) -> bool:
    def make(original: Callable) -> Callable:
        def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
            config = self.neuron_config
            mask = kwargs.get("attention_mask")
            populated = bool(self.neuron_model.kv_cache_populated)
            if config.is_prefix_caching and mask is not None and not populated:
                kwargs["attention_mask"] = _cover_generated(input_ids, mask)
            inputs = original(self, input_ids, *args, **kwargs)
            if not config.is_prefix_caching or inputs.get("full_context_lens") is not None:
                return inputs
            if inputs.get("attention_mask") is None:
                raise ValueError(
                    "generate() with is_prefix_caching=True needs an attention_mask to "
                    "derive full_context_lens; pass attention_mask= (the tokenizer "
                    "returns one)."
                )
            derived = prefix_cache_inputs(
                inputs["attention_mask"],
                populated,
                block_size=config.pa_block_size,
                seq_len=config.seq_len,
                num_blocks=config.pa_num_blocks,
            )
            inputs.update({k: v for k, v in derived.items() if inputs.get(k) is None})
            return inputs

        return prepare_inputs_for_generation

    return replace_method(
        modules.hf_adapter.HuggingFaceGenerationAdapter, "prepare_inputs_for_generation", NAME, make
    )


PATCH = Patch(
    name=NAME,
    defect="HF adapter passes no full/computed context lengths with prefix caching",
    probe=probe,
    apply=apply,
)
