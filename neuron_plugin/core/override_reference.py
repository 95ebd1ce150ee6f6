"""The `override_neuron_config` reference, generated from the schema the plugin checks
(core.override_schema) and the keys it interprets or refuses, so the documented list of
keys is the enforced one (the docs site renders it: scripts/docs_hooks.py)."""

from __future__ import annotations

from dataclasses import dataclass

from neuron_plugin.core.override_checks import UNSUPPORTED_KEYS
from neuron_plugin.core.override_schema import (
    ADDED_IN,
    NXDI_KEYS,
    NXDI_RELEASES,
    PLUGIN_KEY_MEANINGS,
    PLUGIN_KEYS,
    sub_config_fields,
    value_description,
)
from neuron_plugin.core.settings import INTERPRETED_KEYS


@dataclass(frozen=True)
class KeyReference:
    key: str
    value: str  # what a value must be
    releases: str  # the NxDI releases that read it, or "this plugin"
    treatment: str  # what the plugin does with it


def key_reference() -> list[KeyReference]:
    """Every accepted key, sorted."""
    rows = []
    for key, (kind, nullable) in NXDI_KEYS.items():
        added = next((r for r, keys in ADDED_IN.items() if key in keys), NXDI_RELEASES[0])
        rows.append(
            KeyReference(key, value_description(kind, nullable), f"{added}+", _treatment(key))
        )
    for key, kind in PLUGIN_KEYS.items():
        rows.append(
            KeyReference(key, value_description(kind, False), "this plugin", _treatment(key))
        )
    for key, fields in sub_config_fields().items():
        listed = ", ".join(f"`{f}`" for f in fields)
        rows.append(
            KeyReference(
                key,
                f"an object of these fields: {listed}, or null",
                f"{NXDI_RELEASES[0]}+",
                _treatment(key),
            )
        )
    return sorted(rows, key=lambda r: r.key)


def _treatment(key: str) -> str:
    if key in UNSUPPORTED_KEYS:
        return f"refused: {UNSUPPORTED_KEYS[key]}"
    if key in PLUGIN_KEY_MEANINGS:
        return f"read by the plugin: {PLUGIN_KEY_MEANINGS[key]}"
    if key in INTERPRETED_KEYS:
        return "read by the plugin (and passed to NxDI as resolved)"
    return "passed to NxDI's NeuronConfig as given"


def markdown_table() -> str:
    lines = ["| key | value | NxDI releases | how the plugin treats it |", "|---|---|---|---|"]
    for row in key_reference():
        cells = (f"`{row.key}`", row.value, row.releases, row.treatment)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
