"""The architecture table as Markdown: the docs site's (scripts/docs_hooks.py) and
`neuron-plugin models`' (which adds the classes registered in this environment)."""

from __future__ import annotations

from collections.abc import Iterable

from neuron_plugin.core.nxdi_releases import CHECKED
from neuron_plugin.models.table import (
    ROWS,
    ModelRow,
    NxDIModelType,
    NxDIModule,
    NxDSource,
    PluginClass,
    Refused,
)


def cell(source: NxDSource | None) -> str:
    """One release's nxd cell: whose class, in a few words."""
    if source is None:
        return "-"
    if isinstance(source, NxDIModelType):
        return f"NxDI `MODEL_TYPES['{source.key}']`"
    if isinstance(source, NxDIModule):
        return f"NxDI `{source.path.split(':')[1]}` (a module it ships unlisted)"
    if isinstance(source, Refused):
        return "refused"
    owner = "the plugin's" if isinstance(source, PluginClass) else "entry point"
    return f"{owner} `{source.path.split(':')[1]}`"


def markdown(rows: Iterable[ModelRow] = ROWS) -> str:
    """Architecture | name | reference backend | the nxd class per checked release, then
    each refusal's reason."""
    rows = list(rows)
    head = ["architecture", "name", "reference backend"]
    head += [f"nxd on {r.describe()}" for r in CHECKED]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        name = f"{row.name} ({row.note})" if row.note else row.name
        reference = ("yes, and its vision tower" if row.vision else "yes") if row.reference else "-"
        nxd = [cell(row.nxd.get(r.release)) for r in CHECKED]
        lines.append("| " + " | ".join([f"`{row.architecture}`", name, reference, *nxd]) + " |")
    notes = [
        f"- `{row.architecture}` is refused on NxDI {' and '.join(on)}: {reason}."
        for row in rows
        for reason, on in refusals(row).items()
    ]
    return "\n".join([*lines, "", *notes]) + "\n"


def refusals(row: ModelRow) -> dict[str, list[str]]:
    """Each refusal's reason -> the releases refusing for it."""
    found: dict[str, list[str]] = {}
    for release in CHECKED:
        source = row.nxd.get(release.release)
        if isinstance(source, Refused):
            found.setdefault(source.reason, []).append(release.release)
    return found
