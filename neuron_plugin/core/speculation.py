"""Speculative decoding: which of vLLM's `--speculative-config` methods Neuron serves, the
combinations that cannot work, and how verification picks the tokens a step emits.

Three kinds of drafter, all verified inside the token-generation graphs (one call per
step):
- `ngram` (prompt lookup): vLLM's `NgramProposer` proposes up to N drafts per request on
  the host from the request's own tokens; the graph computes the target at the last
  token and every draft (N + 1 positions per row) and accepts a prefix of the drafts.
  On the nxd backend this is NxDI's speculation model (`speculation_length` N + 1 without
  fused speculation), which NxDI builds for the contiguous KV layout only.
- `draft_model`: a small checkpoint of the same vocabulary is fused into the graphs, as
  NxDI's fused speculation (`enable_fused_speculation`, `FusedSpecNeuronConfig`): the
  graph takes one token per row, runs the draft N + 1 times (the last run only writes
  the draft's KV cache for the last draft) and verifies the N drafts with the target.
  vLLM's scheduler still schedules N draft positions per request (the runner hands it
  N placeholders), so KV slots, the rollback of rejected positions and vLLM's
  spec-decode metrics all follow vLLM's own contract.
- `eagle` / `eagle3`: an EAGLE head (core.eagle_heads) fused the same way, reading the
  target's hidden states (NxDI's `enable_eagle_speculation`, `is_eagle3`): the graph
  keeps the target's hidden state (EAGLE-3: the fused feature) of every position, runs
  the head N times from the last token and the hidden state before it, verifies the N
  drafts with the target, then runs the head once more over the N + 1 positions with the
  target's own hidden states, so the head's KV cache holds what EAGLE defines (NxDI
  model_base.py `_eagle_token_gen_forward`; vLLM recomputes them the same way).

NxDI's `speculation_length` counts the last token too: N drafts are speculation_length
N + 1 (vllm-neuron 0.x passed N, which verifies N - 1 drafts).

Verification (`accepted_tokens`): a step emits the drafts the target agrees with, then
one token of the target's own (its correction at the first disagreement, or the bonus
token after the last draft): 1 to N + 1 tokens, never past the row's draft budget (the
drafts vLLM scheduled; fewer near max_model_len or when the token budget is short). How
the target "agrees" is the backend's on-device sampler's rule:
- reference backend: vLLM's rejection sampling (v1/sample/rejection_sampler.py), so
  sampled requests keep their exact distribution: a greedy row accepts a draft equal to
  the target's argmax; a sampled row accepts draft x with probability p_target(x) (the
  drafts are greedy or n-gram, a draft probability of 1) and on rejection draws from
  p_target without x.
- nxd backend: NxDI's rule (model_base.py `_tkg_postprocessor`): every position is the
  target's argmax (`_sample_on_device` with do_sample=False, as vllm-neuron compiles it),
  so while speculation is on a sampled request decodes greedily after its first token.
  The start-up log says so.

Pure: no vLLM or NxDI import.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from neuron_plugin.core.eagle_heads import TargetShape, read_head
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import (
    BLOCK,
    DRAFT_MODEL,
    EAGLE,
    EAGLE3,
    FUSED_METHODS,
    NGRAM,
    EngineLimits,
    NeuronSettings,
)

METHODS = (NGRAM, *FUSED_METHODS)
# vLLM's other hidden-state methods (config/speculative.py EagleModelTypes), refused with
# their own reason.
HIDDEN_STATE_METHODS = frozenset({"mtp", "dflash", "extract_hidden_states"})
# Accepted-token rows are padded with this after a row's last emitted token (NxDI 0.8+'s
# acceptance_padding_token).
NO_TOKEN = -1

_FIX = (
    'use {"method": "ngram", ...}, {"model": DRAFT_DIR, ...} (method draft_model) or '
    '{"method": "eagle" or "eagle3", "model": HEAD_DIR, ...}'
)


def resolve_speculation(
    limits: EngineLimits,
    *,
    backend: str,
    kv_layout: str,
    on_device_sampling: bool,
    batch_bucketing: bool,
) -> tuple[str | None, int, str | None]:
    """(method, num_speculative_tokens, draft folder) from vLLM's --speculative-config,
    or (None, 0, None) without it; what cannot work is refused naming the fix."""
    method = limits.speculative_method
    if method is None:
        return None, 0, None
    flag = f"--speculative-config method {method!r}"
    if method in HIDDEN_STATE_METHODS or method.startswith("mtp"):
        raise NeuronConfigError(
            f"{flag}: MTP, DFlash and hidden-state extraction are not compiled by this "
            f"plugin (its hidden-state drafters are EAGLE and EAGLE-3 heads); {_FIX}."
        )
    if method not in METHODS:
        raise NeuronConfigError(
            f"{flag} is not served on Neuron: the token-generation graphs verify n-gram "
            f"(prompt lookup) drafts or a fused draft model's; {_FIX}."
        )
    if not on_device_sampling:
        raise NeuronConfigError(
            f"{flag} with on-device sampling off: drafts are verified by the sampler "
            f"compiled into the token-generation graphs (NxDI asserts "
            f"on_device_sampling_config for speculation); remove "
            f"on_device_sampling_config: null / NEURON_ON_DEVICE_SAMPLING_DISABLED, or "
            f"remove --speculative-config."
        )
    draft = None
    if method in FUSED_METHODS:
        draft = _draft_folder(limits.draft_model)
        if method in (EAGLE, EAGLE3) and limits.target_shape is not None:
            read_head(method, draft, TargetShape(*limits.target_shape))  # refuses a misfit
    if backend == "nxd":
        if method == NGRAM and kv_layout == BLOCK:
            raise NeuronConfigError(
                f"{flag} with the block KV layout (prefix caching or chunked prefill) on "
                f"the nxd backend: NxDI's speculation model, which verifies host "
                f"proposals, has no prefix-caching graphs (model_base.py "
                f"_get_model_outputs routes block-layout decodes to the token-generation "
                f"or fused model only); remove --enable-prefix-caching / "
                f"--enable-chunked-prefill, or use a draft model."
            )
        if batch_bucketing:
            raise NeuronConfigError(
                f"{flag} with override_neuron_config.token_generation_batches: NxDI "
                f"refuses batch bucketing with speculation (models/config.py "
                f"_validate_batch_bucketing_compatibility); remove token_generation_batches."
            )
    return method, limits.num_speculative_tokens, draft


def _draft_folder(path: str | None) -> str:
    if not path or not (Path(path) / "config.json").is_file():
        raise NeuronConfigError(
            f"--speculative-config model={path!r}: the draft model or EAGLE head must be a "
            f"local checkpoint folder (config.json and *.safetensors) the backend reads, as the "
            f"target is; download it first (e.g. huggingface-cli download) and pass its path."
        )
    return str(Path(path).resolve())


def speculation_summary(method: str | None, drafts: int, backend: str) -> str | None:
    """What speculation does with these settings (the start-up log line), None without."""
    if method is None:
        return None
    proposer = {
        NGRAM: "prompt lookup on the host (vLLM's NgramProposer)",
        DRAFT_MODEL: "a draft model fused into the token-generation graphs",
    }.get(method, f"an {method} head on the target's hidden states, fused into the graphs")
    rule = (
        "NxDI verifies every position with the target's argmax, so a request with "
        "temperature > 0 decodes greedily after its first token while speculation is on"
        if backend == "nxd"
        else "verification keeps each request's sampling distribution (vLLM's rejection sampling)"
    )
    return (
        f"speculative decoding: {method}, up to {drafts} drafts a step from {proposer}, "
        f"verified in token-generation graphs of {drafts + 1} positions a row; {rule}; "
        f"async scheduling is off (a step's inputs start after the tokens the previous "
        f"step accepted)"
    )


def host_sampling_refusal(settings: NeuronSettings, why: str) -> str | None:
    """Why a request that needs the host sampler (`why`: what it asks for) cannot be
    served, or None. A fused draft model on the nxd backend compiles no logits: NxDI's
    fused context encoding lists its logits outputs out of line with the KV cache the
    wrapper aliases (model_base.py _context_encoding_forward, ef2731e lines 1800-1809,
    against model_wrapper.py 1588-1610), and vllm-neuron never compiles it with logits."""
    if settings.backend != "nxd" or not settings.is_fused_speculation:
        return None
    return (
        f"{why}, but with a draft model or EAGLE head (--speculative-config) the nxd "
        f"backend's graphs return tokens only (NxDI's fused speculation cannot also return "
        f"logits); drop "
        f"that option (greedy, temperature, top_k and top_p are sampled on the device), "
        f'or serve with {{"method": "ngram"}} speculation or none'
    )


def emitted(tokens: np.ndarray) -> list[list[int]]:
    """Each row's emitted tokens from an accepted-tokens array [rows, width] padded with
    NO_TOKEN (a speculative call's answer; width 1 without speculation)."""
    keep = tokens != NO_TOKEN
    return [row[mask].tolist() for row, mask in zip(tokens, keep, strict=True)]


def accepted_tokens(drafts: np.ndarray, target: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """NxDI's acceptance rule (model_base.py `_tkg_postprocessor`), for a graph that
    returns the target's token at every position rather than the accepted tokens (NxDI's
    speculation model): the drafts that equal the target's token before them, then the
    target's own token, padded with NO_TOKEN. `drafts` [rows, width - 1] are the
    proposals, `target` [rows, width] the target's token after the last token and after
    each draft, `budget` [rows] how many drafts each row may accept."""
    width = target.shape[1]
    agree = (drafts == target[:, :-1]) & (np.arange(width - 1)[None, :] < budget[:, None])
    run = np.cumprod(agree, axis=1).sum(axis=1)  # leading accepted drafts
    keep = np.arange(width)[None, :] <= run[:, None]
    return np.where(keep, target, NO_TOKEN).astype(np.int32)
