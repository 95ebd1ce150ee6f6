"""NxDI's answers as the NxD contract's: the tokens each row emits and the logits of a
call's first position.

Without speculation NxDI's on-device sampler answers a token per row (`.tokens`) and,
with `output_logits`, the logits (`.logits`, [rows, 1, vocab]) (model_base.py
NeuronBaseForCausalLM._get_constructed_outputs, ef2731e lines 3797-3830).

With speculation (core.speculation):
- the n-gram speculation model answers the target's argmax at every position
  (`.tokens` [rows, speculation_length], model_base.py `_sample_on_device`, lines
  1163-1173) and its logits [rows, speculation_length, vocab]; the host applies NxDI's
  acceptance rule (`core.speculation.accepted_tokens`) within each row's draft budget;
- fused speculation answers `.fused_outputs` = [accepted tokens [rows, k], next input
  ids, next attention mask, next position ids] (+ draft logits, target logits
  [rows, k, vocab] with `output_logits`) (model_base.py NeuronFusedSpecModel.forward
  and `_tkg_postprocessor`, lines 2799-2855, 3003-3021; the KV caches are aliased, not
  returned, model_wrapper.py lines 1580-1610). The accepted tokens are padded with -1
  from NxDI 0.8 on and with 0 in 0.7 (`acceptance_padding_token`), so a row's count
  comes from its next position id minus its position, as vllm-neuron's
  `_remask_fused_spec_output` counts it. NxDI accepts up to k - 1 drafts whatever
  vLLM scheduled, so each row is cut to its draft budget + 1 tokens: the positions
  past the budget have no KV slot of vLLM's (their writes went to NxDI's reserved
  block) and vLLM rolls back what it did not schedule. A fused context encoding
  answers [target token, pad...] (`_cte_postprocessor`): its first column.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from neuron_plugin.core.inputs import CONTEXT_ENCODING, ForwardInputs
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.speculation import NO_TOKEN, accepted_tokens

# Indices into a fused answer's outputs (model_base.py NeuronFusedSpecModel.forward).
ACCEPTED, NEXT_POSITION_IDS, TARGET_LOGITS = 0, 3, 5


def call_budget(inputs: ForwardInputs, answer: np.ndarray, rows: int) -> np.ndarray:
    """[rows] draft budget of every row of NxDI's call (0 for its pad rows); `answer[i]`
    is the call row of real row i."""
    budget = np.zeros(rows, dtype=np.int64)
    budget[answer] = inputs.draft_budget[: inputs.num_real]
    return budget


def emitted_tokens(
    settings: NeuronSettings,
    inputs: ForwardInputs,
    args: dict[str, np.ndarray],
    output: Any,
    budget: np.ndarray,
) -> np.ndarray:
    """[call rows, 1 or speculation_length] int32: the tokens each row of the call emits,
    padded with NO_TOKEN (see the module docstring); `budget` from `call_budget`."""
    rows = int(args["seq_ids"].shape[0])
    if settings.is_fused_speculation:
        fused = output.fused_outputs
        accepted = fused[ACCEPTED].reshape(rows, -1).numpy().astype(np.int32)
        if inputs.phase == CONTEXT_ENCODING:
            return accepted[:, :1]
        positions = args["position_ids"][:, 0]
        generated = fused[NEXT_POSITION_IDS].reshape(rows).numpy().astype(np.int64) - positions
        count = np.minimum(generated, budget + 1)
        keep = np.arange(accepted.shape[1])[None, :] < count[:, None]
        return np.where(keep, accepted, NO_TOKEN).astype(np.int32)
    tokens = output.tokens.reshape(rows, -1).numpy().astype(np.int32)
    if inputs.phase == CONTEXT_ENCODING or not settings.speculation_length:
        return tokens[:, -1:]
    # The speculation model: the target's argmax after the last token and each draft.
    return accepted_tokens(args["input_ids"][:, 1:], tokens, budget)


def first_position_logits(settings: NeuronSettings, output: Any) -> torch.Tensor:
    """[call rows, padded vocab]: the logits at each row's first computed position (its
    last token's; the only position of a call without speculation)."""
    if settings.is_fused_speculation:
        fused = output.fused_outputs
        if len(fused) <= TARGET_LOGITS:
            raise ValueError(
                "NxDI's fused speculation answered without logits (output_logits off); "
                "this is a plugin bug, please report it with your override_neuron_config."
            )
        logits = fused[TARGET_LOGITS]
    else:
        logits = output.logits
    return logits[:, 0, :] if logits.dim() == 3 else logits
