"""What the nxd backend serves per architecture and feature, and the configurations it
refuses before anything compiles.

The evidence is real NxD Inference in its CPU mode, each release of
`core.nxdi_releases.CHECKED` (0.8.0 cd3abf3, the release inf2/trn1 run, and 0.9.0
ef2731e), driven through this backend against transformers' greedy tokens and logits on
a tiny checkpoint of each architecture (`tests/e2e/test_nxdi_architectures.py`, `pytest
-m nxdi`, once per release): contiguous and block layout at batch 1 and 2, a 128-token
prefix-cache hit, on-device sampling. Each family's module (`families/`, the room
`models.table` names) holds its table per release, its windows and its refusals; this
module reads them for an architecture. The reference backend follows transformers, so an
architecture it serves is no evidence for nxd. Every feature of an architecture is one
of: equal to transformers on real NxDI, refused (why, what to use instead), or untested
(why).

`problems` refuses, naming architecture, NxDI release, feature and fix, what NxDI's
modelling code computes differently from transformers (measured, or read in its source:
file and function named) where no patch of `neuron_plugin.patches` makes it equal: the
sliding windows NxDI's model applies differently from transformers once a sequence can
pass them (every family), and what each family's `problems` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd.families import (
    NxDFamily,
    dbrx,
    family,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    llama4,
    mistral,
    mixtral,
    pixtral,
    qwen2,
    qwen2_vl,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_vl,
    transformers_windows,
)
from neuron_plugin.backends.nxd.support import FEATURES, REFUSED, UNTESTED, Support, Table
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.checkpoint import text_config
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.models.table import TABLE, Refused

FAMILIES: dict[str, NxDFamily] = {
    module.__name__.rsplit(".", 1)[1]: family(module)
    for module in (
        llama,
        mistral,
        mixtral,
        qwen2,
        qwen3,
        qwen3_moe,
        qwen3_vl,
        pixtral,
        llama4,
        qwen2_vl,
        dbrx,
        gpt_oss,
        gemma3,
        gemma4,
        qwen3_5,
    )
}
# A class of nobody's family (an entry point's, or an architecture outside the table).
_UNKNOWN = NxDFamily(support={})
_UNMAPPED = Support(UNTESTED, "not an architecture this plugin maps")


def family_of(architecture: str) -> NxDFamily:
    row = TABLE.get(architecture)
    return FAMILIES.get(row.family, _UNKNOWN) if row else _UNKNOWN


def table(architecture: str, release: nxdi_releases.NxDIRelease) -> Table:
    return family_of(architecture).support.get(release.release, {})


def support(architecture: str, release: nxdi_releases.NxDIRelease) -> dict[str, str]:
    """Feature -> its status on the nxd backend with `release`, for the report of
    `architecture` (an architecture the table refuses on the release: refused, with the
    reason; one outside the table, e.g. a contrib model's: untested)."""
    row = TABLE.get(architecture)
    source = row.nxd.get(release.release) if row else None
    if isinstance(source, Refused):
        return dict.fromkeys(FEATURES, Support(REFUSED, source.reason).describe())
    found = table(architecture, release)
    return {feature: found.get(feature, _UNMAPPED).describe() for feature in FEATURES}


def explain(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    environ: Mapping[str, str],
    release: nxdi_releases.NxDIRelease,
) -> tuple[dict[str, str], list[str]]:
    """(the architecture's support table, this configuration's problems) with `release`
    (the instance family's), for `neuron-plugin explain-config`, without NxDI: the
    patches count as applied unless VLLM_NEURON_DISABLE_PATCHES switches them off."""
    from neuron_plugin.patches import disabled_patches

    status = dict.fromkeys(disabled_patches(environ), "disabled")
    found = problems(settings, hf_config, release.describe().removeprefix("NxDI "), status)
    return support(settings.architecture, release), found


def config_adjustments(settings: NeuronSettings, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """InferenceConfig attributes the backend sets after NxDI built it (the family's)."""
    return family_of(settings.architecture).adjustments(settings, text_config(dict(hf_config)))


def nxdi_windows(
    architecture: str, text: Mapping[str, Any], max_model_len: int
) -> tuple[int | None, ...]:
    """Each layer's sliding window as NxDI's model applies it, with the plugin's
    patches and adjustments (the family's `windows`)."""
    return family_of(architecture).windows(text, max_model_len)


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    nxdi_version: str | None,
    patch_status: Mapping[str, str],
) -> list[str]:
    """Every reason this configuration would not give transformers' tokens on NxDI
    (see the module docstring); `patch_status` maps patch names to their outcome
    ("applied", "already applied", "not needed", "disabled")."""
    text = text_config(dict(hf_config))
    release = f"NxDI {nxdi_version or '(unknown version)'}"
    found = _window_problems(settings, text, release) + _padded_vocabulary_problems(
        settings, text, release
    )
    own = family_of(settings.architecture).problems
    return found + own(settings, hf_config, text, release, patch_status)


def _padded_vocabulary_problems(
    settings: NeuronSettings, text: Mapping[str, Any], release: str
) -> list[str]:
    """Host sampling at a TP degree that does not divide the vocabulary. NxDI's lm_head
    (neuronx-distributed ColumnParallelLinear, pad=True) pads the vocabulary to a multiple
    of the TP degree; without on-device sampling it gathers the logits and cuts the
    padding off (_cpl_maybe_gather_output), and NeuronBaseModel.forward then masks the last
    pad columns as if they were still there (model_base.py mask_padded_logits with
    world_size 1: 0.8 lines 1031-1039, 0.9 lines 990-999), which are real tokens by then.
    Measured in NxDI 0.8's and 0.9's CPU mode at TP 2 on a 977-token vocabulary: token
    976's logit is the float minimum."""
    vocab, tp = int(text.get("vocab_size") or 0), settings.tp_degree
    if settings.on_device_sampling or tp == 1 or not vocab or vocab % tp == 0:
        return []
    pad = -vocab % tp
    hidden = f"token {vocab - 1}" if pad == 1 else f"tokens {vocab - pad}..{vocab - 1}"
    return [
        f"on-device sampling off (on_device_sampling_config: null) at "
        f"--tensor-parallel-size {tp} with a vocabulary of {vocab} (not a multiple of {tp}) "
        f"on {release}: NxDI masks the last {pad} real tokens' logits to the float minimum "
        f"(its lm_head's padding is cut off before the pad mask runs), so {hidden} "
        f"could never be sampled; keep on-device sampling on, or "
        f"use a --tensor-parallel-size that divides {vocab}."
    ]


def _window_problems(settings: NeuronSettings, text: Mapping[str, Any], release: str) -> list[str]:
    theirs = transformers_windows(settings.architecture, text)
    ours = nxdi_windows(settings.architecture, text, settings.max_model_len)
    differ = [
        i
        for i, (t, n) in enumerate(zip(theirs, ours, strict=True))
        if t != n and min(w for w in (t, n) if w is not None) < settings.max_model_len
    ]
    if not differ:
        return []
    shortest = min(w for i in differ for w in (theirs[i], ours[i]) if w is not None)
    return [
        f"{settings.architecture} on {release}: layers {differ} have sliding windows "
        f"{[theirs[i] for i in differ]} in transformers but {[ours[i] for i in differ]} in "
        f"NxDI's model (None: all positions), so tokens differ once a sequence is longer "
        f"than {shortest} tokens; serve with --max-model-len {shortest} or less, or on the "
        f"reference backend (VLLM_NEURON_BACKEND=reference)."
    ]
