"""The states a feature of an architecture has on the nxd backend, per NxDI release, and
the rows most families share. Each family's table is in its module (`families/`);
`compat` reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from neuron_plugin.core import nxdi_releases

EQUAL = "equal to transformers on real NxDI"
REFUSED = "refused"
UNTESTED = "untested"
FEATURES = (
    "contiguous",
    "block",
    "prefix_hit",
    "on_device_sampling",
    "speculation",
    "lora",
    "quantization",
)


@dataclass(frozen=True)
class Support:
    """One feature of one architecture on the nxd backend."""

    state: str  # EQUAL, REFUSED or UNTESTED
    note: str = ""

    def describe(self) -> str:
        return f"{self.state}: {self.note}" if self.note else self.state


Table = Mapping[str, Support]  # feature -> its state

SPECULATION = Support(UNTESTED, "NxDI's CPU mode runs no speculation (application_base.py to_cpu)")
WINDOWED_SPECULATION = Support(
    REFUSED,
    "sliding-window attention: NxDI verifies drafts for it only with a token-generation "
    "kernel its speculation model lacks",
)
LORA = Support(UNTESTED, "NxDI's CPU mode cannot run LoRA (model_base.py _copy_past_key_values)")
# NxDI 0.8's LoraModelManager.add_adapter loads nothing (lora.py NxDILora.streams_adapters)
LORA_0_8 = Support(
    UNTESTED,
    "NxDI's CPU mode cannot run LoRA; NxDI 0.8 loads no adapter at run time (start "
    "adapters, lora_ckpt_paths, only)",
)
QUANTIZED = Support(
    UNTESTED,
    "NxDI's CPU mode loads quantized weights without converting them (application_base.py to_cpu)",
)
COMMON: Table = {
    "contiguous": Support(EQUAL),
    "block": Support(EQUAL),
    "prefix_hit": Support(EQUAL),
    "on_device_sampling": Support(EQUAL),
    "speculation": SPECULATION,
    "lora": LORA,
    "quantization": QUANTIZED,
}


def by_release(table_0_9: Table, table_0_8: Table | None = None) -> dict[str, Table]:
    """Release -> feature table: 0.9's as given; 0.8's as given, or 0.9's with 0.8's
    LoRA (no adapter loaded at run time)."""
    return {
        nxdi_releases.NXDI_0_8.release: table_0_8 or {**table_0_9, "lora": LORA_0_8},
        nxdi_releases.NXDI_0_9.release: table_0_9,
    }
