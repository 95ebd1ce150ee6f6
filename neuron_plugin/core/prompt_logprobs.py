"""Prompt logprobs: which graphs serve them, and what a call carries for them.

vLLM's `prompt_logprobs` (and `echo: true` with `logprobs` on /v1/completions, which
lm-evaluation-harness sends for every loglikelihood task) asks for each prompt
position's log-probability of the next prompt token and the k most likely tokens there.
A context-encoding graph returns the logits of the last prompt token only, and a
[positions, vocab] float tensor per prompt would leave the device (~1.2 GB at a 2048
bucket and a 151,936-token vocabulary). So the plugin compiles, beside each
context-encoding graph, one that computes every position's log-softmax, its top
`max_logprobs` and the target token's logprob and rank inside the graph and returns
[positions, max_logprobs + 1] ids and values: O(k) per prompt token.

The graphs double the context-encoding graphs, minutes each on Neuron, so they are
compiled where `additional_config.prompt_logprobs` is true; `--max-logprobs` (vLLM's
bound on a request's k, 20 by default) is their k. Pure numpy: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from neuron_plugin.core.errors import NeuronConfigError

# The `additional_config` key that compiles the prompt-logprob graphs.
PROMPT_LOGPROBS_KEY = "prompt_logprobs"
# A target position without a token to score (padding, the prompt's last position).
NO_TARGET = -1
# vLLM's logprobs modes whose scores are log-probabilities (the graphs compute those).
LOGPROB_MODES = ("raw_logprobs", "processed_logprobs")


def resolve_prompt_logprobs(value: object, max_logprobs: int, logprobs_mode: str) -> int | None:
    """The k the prompt-logprob graphs return (None: no such graphs) from
    `additional_config.prompt_logprobs` (absent: false), vLLM's --max-logprobs and
    --logprobs-mode."""
    if value is None or value is False:
        return None
    if value is not True:
        raise NeuronConfigError(
            f"additional_config.{PROMPT_LOGPROBS_KEY}={value!r} must be true or false: true "
            f"compiles graphs that serve prompt_logprobs (and echo with logprobs); fix or "
            f"remove it."
        )
    if max_logprobs < 0:
        raise NeuronConfigError(
            f"--max-logprobs {max_logprobs} (the whole vocabulary) with additional_config."
            f"{PROMPT_LOGPROBS_KEY}=true: the prompt-logprob graphs return the top "
            f"--max-logprobs tokens of every prompt position, and a whole vocabulary per "
            f"position is what they exist to keep on the device; set --max-logprobs to the "
            f"largest k your clients ask for (vLLM's default is 20)."
        )
    if logprobs_mode not in LOGPROB_MODES:
        raise NeuronConfigError(
            f"--logprobs-mode {logprobs_mode} with additional_config.{PROMPT_LOGPROBS_KEY}="
            f"true: the prompt-logprob graphs compute log-probabilities; use "
            f"--logprobs-mode {' or '.join(LOGPROB_MODES)}, or drop {PROMPT_LOGPROBS_KEY}."
        )
    return max_logprobs


# NxDI NeuronConfig keys whose context encoding keeps the last position's hidden state
# only, before the lm_head the nxd prompt-logprob graphs read every position from.
LAST_TOKEN_ONLY = {
    # get_model_output slices it (seq_parallel_slice_last_token, NxDI 0.9 model_base.py
    # line 1453, 0.8 line 1480)
    "sequence_parallel_enabled": "its hidden states are sliced to the last token inside "
    "NxDI's get_model_output",
    # forward keeps each window's last hidden state (NxDI 0.9 model_base.py lines
    # 876-919, `prev_max_hidden_states`)
    "windowed_context_encoding_size": "NxDI's forward keeps each window's last hidden state only",
}


def refuse_last_token_only(override: Mapping[str, object]) -> None:
    """On nxd: refuse the NxDI keys whose context encoding has no per-position hidden
    states for the prompt-logprob graphs (`LAST_TOKEN_ONLY`)."""
    for key, why in LAST_TOKEN_ONLY.items():
        if override.get(key):
            raise NeuronConfigError(
                f"additional_config.{PROMPT_LOGPROBS_KEY}=true with override_neuron_config."
                f"{key}={override[key]!r} on the nxd backend: {why}, so no graph can score "
                f"every prompt position; remove {key} or drop {PROMPT_LOGPROBS_KEY}."
            )


def prompt_targets(prompt_ids: np.ndarray, start: int, count: int, active: int) -> np.ndarray:
    """[1, active] int64: for each position start..start+count-1 of a prefill call, the
    prompt token after it (whose logprob vLLM reports there), NO_TARGET past the prompt's
    last token and on padding. vLLM's rule (gpu_model_runner `_get_prompt_logprobs_dict`):
    position i scores prompt token i + 1, for i < len(prompt) - 1."""
    targets = np.full((1, active), NO_TARGET, dtype=np.int64)
    scored = max(0, min(count, len(prompt_ids) - start - 1))
    targets[0, :scored] = prompt_ids[start + 1 : start + 1 + scored]
    return targets


def scored_positions(targets: np.ndarray) -> int:
    """How many leading positions of a call's (single-row) targets are scored."""
    return int((targets[0] != NO_TARGET).sum())


@dataclass(frozen=True)
class PromptLogprobs:
    """A call's prompt logprobs for its scored positions, in vLLM's layout
    (`Sampler.gather_logprobs`): column 0 is the target token, columns 1.. the top-k in
    descending order; `ranks` is the target's rank (1 = the most likely)."""

    token_ids: np.ndarray  # [positions, k + 1] int32
    logprobs: np.ndarray  # [positions, k + 1] float32
    ranks: np.ndarray  # [positions] int64

    ARRAYS = ("token_ids", "logprobs", "ranks")

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @property
    def positions(self) -> int:
        return int(self.ranks.shape[0])

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())
