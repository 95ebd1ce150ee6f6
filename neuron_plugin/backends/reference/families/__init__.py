"""The reference backend's room per model family (`models.table` names each row's):
each module holds its architectures' `Architecture` rows (`ARCHITECTURES`), the
DecoderSpec fields only it has (`Architecture.spec_fields`), and for a vision-language
family its tower (`tower(config)`, see `reference.vision`)."""

from __future__ import annotations

from types import ModuleType

from neuron_plugin.backends.reference.architecture import Architecture, UnsupportedModelError
from neuron_plugin.backends.reference.families import (
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
)
from neuron_plugin.models.table import TABLE, reference_architectures

FAMILIES: dict[str, ModuleType] = {
    module.__name__.rsplit(".", 1)[1]: module
    for module in (
        llama,
        mistral,
        mixtral,
        qwen2,
        qwen3,
        qwen3_moe,
        gemma3,
        gemma4,
        qwen3_5,
        gpt_oss,
        qwen2_vl,
        qwen3_vl,
        pixtral,
        llama4,
    )
}
ARCHITECTURES: dict[str, Architecture] = {
    name: arch for module in FAMILIES.values() for name, arch in module.ARCHITECTURES.items()
}


def family_module(architecture: str) -> ModuleType:
    """The module serving `architecture` on the reference backend (the table's family)."""
    row = TABLE.get(architecture)
    if row is None or not row.reference or row.family not in FAMILIES:
        raise UnsupportedModelError(
            f"architectures=[{architecture!r}] is not supported by the reference backend "
            f"(supported: {', '.join(reference_architectures())}); use "
            f"VLLM_NEURON_BACKEND=nxd on a Neuron host for other models."
        )
    return FAMILIES[row.family]
