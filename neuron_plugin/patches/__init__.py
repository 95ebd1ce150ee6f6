"""Fixes for defects in NxD Inference's adapter layer, each applied only where a probe
finds the defect in the installed NxDI.

A probe inspects a signature or runs the defective code path on a stand-in input; it
never reads a version string, so a fixed NxDI release is left alone and a backport of
a fix is recognised. Every fix is idempotent, logs one line, and can be switched off with
`VLLM_NEURON_DISABLE_PATCHES=name[,name...]` (or `all`). This package never imports
NxDI: `neuron_plugin.backends.nxd` hands it the NxDI modules (`NxDIModules`), so tests
hand it modules that reproduce NxDI's defective and fixed code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from neuron_plugin import plugin_logger
from neuron_plugin.patches import (
    adapter_inputs,
    bucket_fit,
    cpu_captured_offset,
    gemma3,
    i2t_capture_hook,
    llama4_rope,
    prefix_lens,
    prefix_prefill_mask,
    qwen2_vl_mrope,
    sampler_top_p,
    vision_scatter,
)
from neuron_plugin.patches.base import NxDIModules, Patch

logger = plugin_logger(__name__)

DISABLE_ENV = "VLLM_NEURON_DISABLE_PATCHES"
PATCHES: tuple[Patch, ...] = (
    adapter_inputs.PATCH,
    prefix_lens.PATCH,
    bucket_fit.PATCH,
    prefix_prefill_mask.PATCH,
    sampler_top_p.PATCH,
    cpu_captured_offset.PATCH,
    *gemma3.PATCHES,
    i2t_capture_hook.PATCH,
    vision_scatter.PATCH,
    llama4_rope.PATCH,
    qwen2_vl_mrope.PATCH,
)

__all__ = [
    "DISABLE_ENV",
    "PATCHES",
    "NxDIModules",
    "Patch",
    "PatchOutcome",
    "apply_patches",
    "disabled_patches",
]


@dataclass(frozen=True)
class PatchOutcome:
    """What happened to one patch: applied, already applied, not needed, disabled."""

    name: str
    status: str
    detail: str


def disabled_patches(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """Names switched off by `VLLM_NEURON_DISABLE_PATCHES`; an unknown name is an error
    so a typo does not leave a patch silently on."""
    names = {p.name for p in PATCHES}
    value = environ.get(DISABLE_ENV, "")
    chosen = {part.strip() for part in value.split(",") if part.strip()}
    if "all" in chosen:
        return frozenset(names)
    unknown = sorted(chosen - names)
    if unknown:
        raise ValueError(
            f"{DISABLE_ENV}={value!r} names unknown patch(es) {', '.join(unknown)}; use "
            f"'all' or any of {', '.join(sorted(names))}."
        )
    return frozenset(chosen)


def apply_patches(
    modules: NxDIModules, environ: Mapping[str, str] = os.environ
) -> list[PatchOutcome]:
    """Probe and, where the defect is present, fix each registered defect once."""
    disabled = disabled_patches(environ)
    outcomes = []
    for patch in PATCHES:
        if patch.name in disabled:
            outcome = PatchOutcome(patch.name, "disabled", f"switched off by {DISABLE_ENV}")
        else:
            evidence = patch.probe(modules)
            if evidence is None:
                outcome = PatchOutcome(
                    patch.name, "not needed", "the installed NxDI does not have this defect"
                )
            elif patch.apply(modules):
                outcome = PatchOutcome(patch.name, "applied", evidence)
            else:
                outcome = PatchOutcome(patch.name, "already applied", evidence)
        logger.info(
            "NxDI patch %s: %s (%s; %s)", outcome.name, outcome.status, patch.defect, outcome.detail
        )
        outcomes.append(outcome)
    return outcomes
