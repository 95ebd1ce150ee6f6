"""On-device sampling: which rows the device may sample, and what a call carries for them.

NxDI's on-device sampler (modules/generation/sampling.py, `dynamic=True`) applies each
row's top-k (at most `global_topk`), temperature and top-p, and nothing else. A request
that asks for anything more (penalties, min-p, logit bias, logprobs, a grammar, its own
seed, ...) needs its logits on the host, where vLLM's sampler serves it; every other
request gets its token from the device and its logits never leave it. The decision is a
pure function of the request's `SamplingParams` (read by attribute, so this module
imports no vLLM), shared by the model runner and both backends.

`SamplingInputs` is what one backend call carries per real row, in NxDI's encoding
(vllm-neuron's `prepare_sampling_params`): greedy rows are top-k 1 at temperature 1, and
rows the device does not sample get those same harmless values. `uniform` is the row's
random draw in [0, 1), made on the host from the engine's seeded generator: a backend
that samples by inverse CDF (the reference backend) uses it, NxDI draws its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# OnDeviceSamplingConfig.global_topk's default: the most candidates the device sampler
# keeps per row.
DEFAULT_GLOBAL_TOPK = 256
# vLLM's _SAMPLING_EPS: a temperature below it means greedy.
SAMPLING_EPS = 1e-5
# vllm-neuron's switch: a non-zero integer turns on-device sampling off.
DISABLED_ENV = "NEURON_ON_DEVICE_SAMPLING_DISABLED"


def on_device_refusal(params: Any, global_topk: int = DEFAULT_GLOBAL_TOPK) -> str | None:
    """Why the on-device sampler cannot serve a request (None: it can). It applies
    temperature, top-k (at most `global_topk`) and top-p only; anything else needs the
    host sampler and therefore the logits."""
    checks = (
        (getattr(params, "presence_penalty", 0.0) != 0.0, "presence_penalty"),
        (getattr(params, "frequency_penalty", 0.0) != 0.0, "frequency_penalty"),
        (getattr(params, "repetition_penalty", 1.0) != 1.0, "repetition_penalty"),
        (getattr(params, "min_p", 0.0) != 0.0, "min_p"),
        (bool(getattr(params, "logit_bias", None)), "logit_bias"),
        (bool(getattr(params, "allowed_token_ids", None)), "allowed_token_ids"),
        (bool(getattr(params, "bad_words", None)), "bad_words"),
        (getattr(params, "logprobs", None) is not None, "logprobs"),
        (getattr(params, "logprob_token_ids", None) is not None, "logprob_token_ids"),
        (getattr(params, "prompt_logprobs", None) is not None, "prompt_logprobs"),
        (getattr(params, "seed", None) is not None, "seed"),
        (getattr(params, "min_tokens", 0) > 0, "min_tokens"),
        (getattr(params, "structured_outputs", None) is not None, "structured_outputs"),
        (getattr(params, "thinking_token_budget", None) is not None, "thinking_token_budget"),
    )
    for refused, name in checks:
        if refused:
            return f"{name} needs the host sampler"
    greedy = params.temperature < SAMPLING_EPS
    if not greedy and not 0 < params.top_k <= global_topk:
        return (
            f"top_k={params.top_k} samples beyond the on-device sampler's global_topk={global_topk}"
        )
    return None


@dataclass(frozen=True)
class SamplingInputs:
    """Per real row of one call (see the module docstring); arrays of equal length."""

    top_k: np.ndarray  # int32, 1 = greedy
    top_p: np.ndarray  # float32 in (0, 1]
    temperature: np.ndarray  # float32 > 0
    uniform: np.ndarray  # float32 in [0, 1)
    needs_logits: np.ndarray  # bool: the host samples this row from its logits

    ARRAYS = ("top_k", "top_p", "temperature", "uniform", "needs_logits")

    @classmethod
    def greedy(cls, rows: int) -> SamplingInputs:
        """Rows nobody samples on the host (padding, warm-up): argmax, no logits."""
        return cls(
            top_k=np.ones(rows, dtype=np.int32),
            top_p=np.ones(rows, dtype=np.float32),
            temperature=np.ones(rows, dtype=np.float32),
            uniform=np.zeros(rows, dtype=np.float32),
            needs_logits=np.zeros(rows, dtype=bool),
        )

    @classmethod
    def for_rows(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        needs_logits: np.ndarray,
        uniform: np.ndarray,
    ) -> SamplingInputs:
        """Encode vLLM's per-row values (temperature 0 = greedy; top_k >= vocab = off)
        as the device sampler takes them."""
        sampled = (temperature >= SAMPLING_EPS) & ~needs_logits
        return cls(
            top_k=np.where(sampled, top_k, 1).astype(np.int32),
            top_p=np.where(sampled, top_p, 1.0).astype(np.float32),
            temperature=np.where(sampled, temperature, 1.0).astype(np.float32),
            uniform=uniform.astype(np.float32, copy=False),
            needs_logits=needs_logits,
        )

    @property
    def rows(self) -> int:
        return len(self.top_k)

    def take(self, index: np.ndarray) -> SamplingInputs:
        """The rows `index` (one backend call's share of a step)."""
        return SamplingInputs(*(getattr(self, name)[index] for name in self.ARRAYS))

    def padded(self, rows: int) -> SamplingInputs:
        """Extended to a graph's `rows` with greedy pad rows."""
        pad = SamplingInputs.greedy(rows - self.rows)
        return SamplingInputs(
            *(np.concatenate([getattr(self, n), getattr(pad, n)]) for n in self.ARRAYS)
        )

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}
