"""On-device sampling: which rows the device may sample, and what a call carries for them.

NxDI's on-device sampler (modules/generation/sampling.py, `dynamic=True`) applies each
row's top-k (at most `global_topk`), temperature and top-p, and nothing else. A request
that asks for anything more (penalties, min-p, logit bias, logprobs, a grammar, its own
seed, ...) needs its logits on the host, where vLLM's sampler serves it; every other
request gets its token from the device and its logits never leave it. The decision is a
pure function of the request's `SamplingParams` (read by attribute, so this module
imports no vLLM), shared by the model runner and both backends.

A random request without a top-k (vLLM's top_k 0 or -1: the whole vocabulary) or with
one above `global_topk` is device-sampled by default with its top-k clamped to
`global_topk`, as vllm-neuron 0.x does (`get_nxd_sampling_params` in
vllm_neuron/worker/neuronx_distributed_model_runner.py sends `max_topk` for any top_k
that is not in (0, max_topk)): it then samples from its `global_topk` most likely
tokens, a distribution docs/configuration/sampling.md measures against the exact one.
`additional_config.exact_sampling: true` keeps such requests exact, on the host.

`SamplingInputs` is what one backend call carries per real row, in NxDI's encoding
(vllm-neuron's `prepare_sampling_params`): greedy rows are top-k 1 at temperature 1, and
rows the device does not sample get those same harmless values; a device row without a
top-k gets `global_topk` explicitly (NxDI reads top_k 0 or -1 as uniform over its
candidates, a different distribution). `uniform` holds the row's random draws in
[0, 1), one per position the call computes (one, or speculation_length), made on the
host from the engine's seeded generator: a backend that samples by inverse CDF (the
reference backend) uses them, NxDI draws its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from neuron_plugin.core.errors import NeuronConfigError

# OnDeviceSamplingConfig.global_topk's default: the most candidates the device sampler
# keeps per row.
DEFAULT_GLOBAL_TOPK = 256
# vLLM's _SAMPLING_EPS: a temperature below it means greedy.
SAMPLING_EPS = 1e-5
# vllm-neuron's switch: a non-zero integer turns on-device sampling off.
DISABLED_ENV = "NEURON_ON_DEVICE_SAMPLING_DISABLED"
# The `additional_config` key that keeps requests without a top-k (or with one above
# global_topk) exact: sampled on the host over the whole vocabulary.
EXACT_SAMPLING_KEY = "exact_sampling"


def resolve_exact_sampling(value: object) -> bool:
    """`additional_config.exact_sampling` (absent: False), which must be a JSON boolean."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise NeuronConfigError(
            f"additional_config.{EXACT_SAMPLING_KEY}={value!r} must be true or false: true "
            f"samples requests without top_k (or with top_k above global_topk) on the host "
            f"over the whole vocabulary, false (the default) on the device from the "
            f"global_topk most likely tokens; fix or remove it."
        )
    return value


def on_device_refusal(
    params: Any, global_topk: int = DEFAULT_GLOBAL_TOPK, exact: bool = False
) -> str | None:
    """Why the on-device sampler cannot serve a request (None: it can). It applies
    temperature, top-k (at most `global_topk`) and top-p only; anything else needs the
    host sampler and therefore the logits. A top-k of 0/-1 (the whole vocabulary) or above
    `global_topk` is clamped to `global_topk` on the device, unless `exact`."""
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
        (getattr(params, "seed", None) is not None, "seed"),
        (getattr(params, "min_tokens", 0) > 0, "min_tokens"),
        (getattr(params, "structured_outputs", None) is not None, "structured_outputs"),
        (getattr(params, "thinking_token_budget", None) is not None, "thinking_token_budget"),
    )
    for refused, name in checks:
        if refused:
            return f"{name} needs the host sampler"
    greedy = params.temperature < SAMPLING_EPS
    if exact and not greedy and not 0 < params.top_k <= global_topk:
        return (
            f"top_k={params.top_k} samples beyond the on-device sampler's "
            f"global_topk={global_topk} and {EXACT_SAMPLING_KEY} is on"
        )
    return None


# vLLM's SamplingParams defaults for what on_device_refusal reads (a request that sets
# nothing itself, before the model's default sampling parameters apply).
VLLM_DEFAULTS: Mapping[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def default_request_refusal(
    defaults: Mapping[str, Any], global_topk: int = DEFAULT_GLOBAL_TOPK, exact: bool = False
) -> str | None:
    """Why the device cannot sample a request that sets nothing itself (None: it can):
    vLLM's defaults overlaid with the model's default sampling parameters `defaults`
    (vLLM's ModelConfig.get_diff_sampling_param: generation_config.json under
    --generation-config auto, and --override-generation-config), which every request
    that leaves a parameter unset takes."""
    return on_device_refusal(SimpleNamespace(**{**VLLM_DEFAULTS, **defaults}), global_topk, exact)


def sampling_summary(on_device: bool, global_topk: int, exact: bool) -> str:
    """What the sampling settings mean for a request (the start-up log line)."""
    if not on_device:
        return "on-device sampling off: every request is sampled on the host from its logits"
    if exact:
        return (
            f"on-device sampling with {EXACT_SAMPLING_KEY}: requests without top_k (or "
            f"with top_k > global_topk={global_topk}) are sampled exactly on the host over "
            f"the whole vocabulary, their logits leaving the device every step"
        )
    return (
        f"on-device sampling: a request without top_k (or with top_k > "
        f"global_topk={global_topk}) samples from its {global_topk} most likely tokens, as "
        f"in vllm-neuron (docs/configuration/sampling.md gives the distance from exact "
        f"sampling); --additional-config '{{\"{EXACT_SAMPLING_KEY}\": true}}' samples "
        f"them exactly on the host"
    )


@dataclass(frozen=True)
class SamplingInputs:
    """Per real row of one call (see the module docstring); arrays of equal length."""

    top_k: np.ndarray  # int32, 1 = greedy
    top_p: np.ndarray  # float32 in (0, 1]
    temperature: np.ndarray  # float32 > 0
    uniform: np.ndarray  # [rows, draws] float32 in [0, 1)
    needs_logits: np.ndarray  # bool: the host samples this row from its logits

    ARRAYS = ("top_k", "top_p", "temperature", "uniform", "needs_logits")

    @classmethod
    def greedy(cls, rows: int, draws: int = 1) -> SamplingInputs:
        """Rows nobody samples on the host (padding, warm-up): argmax, no logits."""
        return cls(
            top_k=np.ones(rows, dtype=np.int32),
            top_p=np.ones(rows, dtype=np.float32),
            temperature=np.ones(rows, dtype=np.float32),
            uniform=np.zeros((rows, draws), dtype=np.float32),
            needs_logits=np.zeros(rows, dtype=bool),
        )

    @classmethod
    def host_rows(cls, rows: int) -> SamplingInputs:
        """Rows the host samples from their logits (a serving call with on-device
        sampling off, e.g. a prompt-logprob call)."""
        return dataclasses.replace(cls.greedy(rows), needs_logits=np.ones(rows, dtype=bool))

    @classmethod
    def for_rows(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        needs_logits: np.ndarray,
        uniform: np.ndarray,
        global_topk: int = DEFAULT_GLOBAL_TOPK,
    ) -> SamplingInputs:
        """Encode vLLM's per-row values (temperature 0 = greedy; top_k 0, -1 or >= vocab
        = off) as the device sampler takes them: a sampled row's top-k outside
        (0, global_topk] becomes `global_topk`."""
        sampled = (temperature >= SAMPLING_EPS) & ~needs_logits
        clamped = np.where((top_k <= 0) | (top_k > global_topk), global_topk, top_k)
        return cls(
            top_k=np.where(sampled, clamped, 1).astype(np.int32),
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
        pad = SamplingInputs.greedy(rows - self.rows, self.uniform.shape[1])
        return SamplingInputs(
            *(np.concatenate([getattr(self, n), getattr(pad, n)]) for n in self.ARRAYS)
        )

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}
