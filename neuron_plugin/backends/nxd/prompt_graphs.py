"""NxDI's context encoding that also scores every prompt position (core.prompt_logprobs).

NxDI's context-encoding graph keeps the last position only: NeuronBaseModel.forward takes
the hidden state at argmax(position_ids) before the lm_head (models/model_base.py,
ef2731e lines 964-976, cd3abf3 1004-1016), and with `output_logits` gathers that one
row's logits across the TP ranks (`_gather_along_dim`, lines 1018-1024). Prompt logprobs
need every position, so where `additional_config.prompt_logprobs` is set the application
gets one more submodel, as `graphs.add_logits_graphs` adds its own: `PROMPT_TAG`, a
deep copy of the context-encoding submodel's config (its buckets: one graph per context
bucket, `NeuronSettings.prompt_logprobs_shapes`), traced from a subclass of the model's
NeuronBaseModel (`prompt_model_class`) whose forward is NxDI's plus, appended after
every output NxDI returns (so the KV caches keep their aliasing indices,
model_wrapper.py DecoderModelInstance.get):
- from the hidden state of every position (NxDI's `get_model_output`, the final norm
  applied), the lm_head's logits, their vocabulary padding masked as NxDI masks it
  (`mask_padded_logits`) where they still hold it, and for each position the logprob
  and rank of the next input token and the top k (k = --max-logprobs), with the
  vocabulary left sharded across the ranks of the column-parallel lm_head
  (backends.prompt_logprobs.sharded_top_logprobs; only k candidates and a few statistics
  per position and rank are gathered);
- the position of the graph's first row, which says which prompt position each row is:
  in the block layout NxDI re-encodes part of the cached prefix in front of the new
  tokens (model_wrapper.py `_pad_prefix_caching_inputs`).
So per bucket position [k + 1] ids and logprobs and a rank leave the device, beside the
one row of logits the context encoding returns anyway. The last new token of a chunk
that is not the prompt's last scores the next chunk's first token, which is not among
the graph's inputs: the host scores it from that row of logits (`scored_answer`).

The submodel is a context encoding to every check NxDI makes (`tag ==
CONTEXT_ENCODING_MODEL_TAG` in model_wrapper.py: compiler arguments, input_generator,
pad_inputs, the prefix-caching bucket and padding; application_base.py per-bucket
configs) while NxD's model builder keys its graphs by its own name (`PromptTag`). Its
wrapper (`prompt_wrapper_class`) takes the appended outputs off before NxDI's
application parses the rest (`_get_constructed_outputs`, and on the CPU
`_copy_past_key_values`, which counts every output after the logits as a KV cache).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.prompt_logprobs import sharded_top_logprobs
from neuron_plugin.core.prompt_logprobs import PromptLogprobs, scored_positions
from neuron_plugin.core.settings import NeuronSettings

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"  # model_wrapper.py's
# The outputs the prompt-logprob submodel appends: ids, logprobs, ranks, first position.
PROMPT_OUTPUTS = 4


class PromptTag(str):
    """The prompt-logprob submodel's tag: its own name (NxD's builder key, its graphs'
    folder) that compares equal to NxDI's context-encoding tag as well, so NxDI treats
    the submodel as the context encoding it is (see the module docstring)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and (
            str.__eq__(self, other) or str.__eq__(other, CONTEXT_ENCODING_MODEL_TAG)
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


PROMPT_TAG = PromptTag("context_encoding_prompt_logprobs_model")


def add_prompt_logprobs_graphs(model: Any, settings: NeuronSettings, model_base: Any) -> None:
    """Before compile, load or to_cpu: the prompt-logprob submodel beside NxDI's context
    encoding where the settings ask for prompt logprobs; nothing otherwise.
    `model_base` is NxDI's models/model_base.py (the helpers its forward uses)."""
    k = settings.prompt_logprobs
    if k is None:
        return
    plain = model.context_encoding_model
    variant = prompt_wrapper_class(type(plain))(
        config=copy.deepcopy(plain.config),
        model_cls=prompt_model_class(plain.model_cls, k, model_base),
        tag=PROMPT_TAG,
        compiler_args=plain.compiler_args,
        model_init_kwargs=plain.model_init_kwargs,
    )
    model.models.append(variant)
    # a submodule of the application, as NxDI's own submodels are (eval(), dtype casts)
    setattr(model, str(PROMPT_TAG), variant)


def prompt_variant(model: Any) -> Any | None:
    """The application's prompt-logprob submodel, if any."""
    return next((w for w in model.models if isinstance(w.tag, PromptTag)), None)


def prompt_answer(model: Any) -> tuple[torch.Tensor, ...]:
    """The appended outputs of the prompt-logprob submodel's last call."""
    variant = prompt_variant(model)
    answer = None if variant is None else variant.prompt_answer
    if answer is None:
        raise RuntimeError(
            "the prompt-logprob submodel has not answered a call; this is a plugin bug, "
            "please report it with your override_neuron_config."
        )
    return tuple(answer)


def prompt_model_class(base: type, k: int, model_base: Any) -> type:
    """`base` (an NxDI NeuronBaseModel) whose forward also returns every position's
    prompt logprobs (see the module docstring)."""

    class PromptLogprobsModel(base):
        prompt_k = k

        def get_model_output(self, *args: Any, **kwargs: Any) -> Any:
            hidden_states, cache = super().get_model_output(*args, **kwargs)
            self.prompt_hidden = hidden_states  # [batch, positions, hidden]
            return hidden_states, cache

        def forward(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
            outputs = super().forward(*args, **kwargs)
            return [*outputs, *prompt_outputs(self, model_base, args[0], args[2])]

    PromptLogprobsModel.__name__ = PromptLogprobsModel.__qualname__ = (
        f"{base.__name__}PromptLogprobs"
    )
    return PromptLogprobsModel


def prompt_outputs(
    module: Any, model_base: Any, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> list[torch.Tensor]:
    """Inside the traced forward: ids and logprobs [batch, positions, k + 1] (column 0
    the next input token), ranks [batch, positions] and the first row's position
    [batch, 1], from `module.prompt_hidden`. The lm_head's vocabulary shards, padding
    and rank as NeuronBaseModel.forward reads them (ef2731e lines 987-999)."""
    head = module.lm_head
    logits = head(module.prompt_hidden).float()
    whole = bool(getattr(head, "gather_output", True))
    if whole:
        rank: torch.Tensor | int = 0

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            return tensor
    else:
        rank = module.rank_util.get_rank()
        group = model_base.get_tp_group(module.config)

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            return model_base._gather_along_dim(
                tensor, partition_dim=tensor.dim() - 1, process_group=group
            )

    # Gathered logits keep the lm_head's padding only with keep_padded_output (the full
    # padded width); otherwise ColumnParallelLinear has cut it off, and masking their tail
    # would hide real tokens (NxDI's own forward does: compat._padded_vocabulary_problems).
    if hasattr(head, "pad_size") and (not whole or logits.shape[-1] == head.output_size):
        world = 1 if whole else torch.distributed.get_world_size(group=head.tensor_parallel_group)
        rank_id = torch.tensor(0, dtype=torch.int32) if whole else rank
        logits = model_base.mask_padded_logits(logits, rank_id, world, pad_size=head.pad_size)
    targets = torch.cat((input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])), dim=1).long()
    ids, logprobs, ranks = sharded_top_logprobs(logits, targets, module.prompt_k, rank, gather)
    return [ids, logprobs, ranks.to(torch.int32), position_ids[:, :1].to(torch.int32)]


def prompt_wrapper_class(base: type) -> type:
    """`base` (NxDI's ModelWrapper class) that keeps the appended prompt-logprob outputs
    of each call (`prompt_answer`) and hands NxDI the rest, as a context encoding's."""

    class PromptLogprobsWrapper(base):
        prompt_answer: tuple[torch.Tensor, ...] | None = None

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            outputs = list(super().forward(*args, **kwargs))
            self.prompt_answer = tuple(outputs[-PROMPT_OUTPUTS:])
            rest = outputs[:-PROMPT_OUTPUTS]
            # on a device one output comes back as a tensor (NxD's packer); the CPU
            # mode's list holds the KV caches too
            return rest[0] if len(rest) == 1 and self.is_neuron() else rest

    PromptLogprobsWrapper.__name__ = PromptLogprobsWrapper.__qualname__ = (
        f"{base.__name__}PromptLogprobs"
    )
    return PromptLogprobsWrapper


def scored_answer(
    answer: tuple[torch.Tensor, ...],
    targets: np.ndarray,
    start: int,
    end: int,
    last_logits: torch.Tensor,
) -> PromptLogprobs:
    """The call's prompt logprobs for its scored positions from the submodel's answer;
    `targets` [1, active] the host's (core.prompt_logprobs.prompt_targets) for prompt
    positions start..end - 1, `last_logits` [vocab] the call's row of logits (position
    end - 1), which scores a target after the call's last token."""
    ids, logprobs, ranks, first = (t.numpy() for t in answer)
    n = scored_positions(targets)
    row = start - int(first[0, 0])
    token_ids = ids[0, row : row + n].astype(np.int32)
    values = logprobs[0, row : row + n].astype(np.float32)
    target_ranks = ranks[0, row : row + n].astype(np.int64)
    wanted = targets[0, :n]
    inside = n - 1 if start + n == end else n  # the last scores past the call's tokens
    if not np.array_equal(token_ids[:inside, 0], wanted[:inside]):
        raise RuntimeError(
            f"NxDI's prompt-logprob graph scored tokens {token_ids[:inside, 0].tolist()} "
            f"where the prompt has {wanted[:inside].tolist()} (positions {start}..); this "
            f"is a plugin bug, please report it with your override_neuron_config."
        )
    if inside < n:
        row_logprobs = last_logits.float().log_softmax(dim=-1)
        target = int(wanted[-1])
        token_ids[-1, 0] = target
        values[-1, 0] = float(row_logprobs[target])
        target_ranks[-1] = int((row_logprobs >= row_logprobs[target]).sum())
    return PromptLogprobs(token_ids, values, target_ranks)
