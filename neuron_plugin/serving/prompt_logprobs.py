"""Prompt logprobs on the serving path: per request, vLLM's `LogprobsTensors` for the
whole prompt, filled call by call (a prompt may take several chunks) from the O(k)
answers of the prompt-logprob graphs (core.prompt_logprobs), handed to vLLM in the step
that computes the prompt's last token, as vLLM's GPU runner does
(gpu_model_runner.py `_get_prompt_logprobs_dict`): position i holds prompt token i+1's
logprob and the top k there, a finished prompt's entry is dropped (a request preempted
later does not score its prompt again), a one-token prompt gets an empty answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.outputs import LogprobsTensors

from neuron_plugin.core.prompt_logprobs import PromptLogprobs


@dataclass
class _Prompt:
    k: int  # the request's prompt_logprobs
    tensors: LogprobsTensors  # [len(prompt) - 1, k + 1]


class PromptScores:
    """The requests that asked for prompt logprobs and are still encoding their prompt."""

    def __init__(self) -> None:
        self._prompts: dict[str, _Prompt] = {}

    def add(self, req_id: str, k: int, prompt_len: int) -> None:
        self._prompts[req_id] = _Prompt(k, LogprobsTensors.empty_cpu(max(prompt_len - 1, 0), k + 1))

    def remove(self, req_id: str) -> None:
        self._prompts.pop(req_id, None)

    def wants(self, req_id: str) -> bool:
        return req_id in self._prompts

    def take(self, req_id: str, start: int, scored: PromptLogprobs) -> None:
        """A call's answer for positions start.. of the request's prompt."""
        prompt = self._prompts[req_id]
        rows = slice(start, start + scored.positions)
        columns = prompt.k + 1
        prompt.tensors.logprob_token_ids[rows] = torch.from_numpy(scored.token_ids[:, :columns])
        prompt.tensors.logprobs[rows] = torch.from_numpy(scored.logprobs[:, :columns])
        prompt.tensors.selected_token_ranks[rows] = torch.from_numpy(scored.ranks)

    def finish(self, req_id: str) -> LogprobsTensors:
        """The request's whole prompt, once its last prompt token is computed."""
        return self._prompts.pop(req_id).tensors
