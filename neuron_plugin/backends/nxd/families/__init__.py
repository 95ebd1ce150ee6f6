"""The nxd backend's room per model family (`models.table` names each row's): what the
family serves per NxDI release and feature (`support`, measured on real NxDI in its CPU
mode), the sliding windows NxDI's model applies (`windows`), what it computes
differently from transformers and no patch fixes (`problems`, refused before anything
compiles), and the config attributes the backend sets after NxDI built its config
(`adjustments`). A class of the plugin's own lives in its family's module too."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from neuron_plugin.backends.nxd.support import Table
from neuron_plugin.core.settings import NeuronSettings

Text = Mapping[str, Any]  # the language model's config keys (core.checkpoint.text_config)
# (settings, config.json, text config, "NxDI 0.9.0+ef2731e", patch outcomes) -> refusals
Problems = Callable[[NeuronSettings, Mapping[str, Any], Text, str, Mapping[str, str]], list[str]]


def layers(text: Text) -> int:
    return int(text.get("num_hidden_layers") or text.get("n_layers") or 0)


def transformers_windows(architecture: str, text: Text) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it (None: full attention),
    from the reference backend's reading of transformers' rules."""
    from neuron_plugin.backends.reference.architectures import layer_windows
    from neuron_plugin.backends.reference.families import ARCHITECTURES

    arch = ARCHITECTURES.get(architecture)
    return (None,) * layers(text) if arch is None else layer_windows(arch, dict(text), layers(text))


def _full_attention(text: Text, max_model_len: int) -> tuple[int | None, ...]:
    return (None,) * layers(text)


def _none(*_: Any) -> list[str]:
    return []


def _no_adjustments(settings: NeuronSettings, text: Text) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class NxDFamily:
    """One family on the nxd backend (see the package docstring)."""

    support: Mapping[str, Table]  # NxDI release -> feature -> state
    # (text config, max_model_len) -> each layer's window as NxDI's model applies it
    windows: Callable[[Text, int], tuple[int | None, ...]] = _full_attention
    problems: Problems = _none
    adjustments: Callable[[NeuronSettings, Text], dict[str, Any]] = _no_adjustments


def family(module: ModuleType) -> NxDFamily:
    found: NxDFamily = module.FAMILY
    return found


def one_decode_length(settings: NeuronSettings, name: str, why: str) -> list[str]:
    """The refusal of token-generation buckets shorter than the largest, for a model whose
    NxDI cache manager hands some layers their whole cache whatever the bucket (`why`:
    which and where), so a shorter bucket's decode fails: "The size of tensor a (64)
    must match the size of tensor b (160)" (tests/e2e/test_nxdi_xla.py, 0.8 and 0.9)."""
    lengths = settings.token_generation_buckets
    shorter = [n for n in lengths if n < lengths[-1]]
    if not shorter:
        return []
    return [
        f"{name}: token_generation_buckets {shorter} are shorter than the largest, "
        f"{lengths[-1]}: {why}, so the graph of a shorter bucket fails to trace (the "
        f"compile on a device; every decode there in the CPU mode); decode at one length: "
        f'override_neuron_config {{"token_generation_buckets": [{lengths[-1]}]}}.'
    ]


def missing_patches(patches: tuple[str, ...], consequence: str) -> Problems:
    """The refusal of a family NxDI cannot serve without the plugin's `patches`: one
    switched off (VLLM_NEURON_DISABLE_PATCHES) would bring `consequence`."""

    def problems(
        settings: NeuronSettings,
        hf_config: Mapping[str, Any],
        text: Text,
        release: str,
        patch_status: Mapping[str, str],
    ) -> list[str]:
        disabled = [p for p in patches if patch_status.get(p) == "disabled"]
        if not disabled:
            return []
        return [
            f"{settings.architecture} on {release} without the plugin's patches "
            f"{', '.join(disabled)} (VLLM_NEURON_DISABLE_PATCHES): {consequence}; remove "
            f"them from VLLM_NEURON_DISABLE_PATCHES."
        ]

    return problems
