"""Classes of others (an NxDI contrib model, a user's own) join the architecture table
through the entry-point group `neuron_plugin.nxdi_models`: an entry point named after a
Hugging Face architecture, whose value is "package.module:NeuronClass" (an NxDI
application class, a `NeuronBaseForCausalLM` subclass). It wins over the table's source
for that architecture, so a contrib model can replace a built-in one; the backend loads
it only when it serves that architecture, and checks it as it checks its own."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Iterable

from neuron_plugin.core.nxdi_releases import CHECKED
from neuron_plugin.models.table import ModelRow, ThirdPartyClass

ENTRY_POINT_GROUP = "neuron_plugin.nxdi_models"


def entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def registered(
    architecture: str, found: Iterable[importlib.metadata.EntryPoint]
) -> tuple[ThirdPartyClass, importlib.metadata.EntryPoint] | None:
    """The class registered for `architecture`, if any (the first entry point of its name)."""
    for ep in found:
        if ep.name == architecture:
            return ThirdPartyClass(ep.value, ENTRY_POINT_GROUP), ep
    return None


def with_registered(
    rows: Iterable[ModelRow], found: Iterable[importlib.metadata.EntryPoint]
) -> list[ModelRow]:
    """The table as this environment serves it: each registered class in its
    architecture's row (on every release), or in a row of its own."""
    by_name = {row.architecture: row for row in rows}
    for ep in found:
        source = ThirdPartyClass(ep.value, ENTRY_POINT_GROUP)
        nxd = {release.release: source for release in CHECKED}
        known = by_name.get(ep.name)
        by_name[ep.name] = (
            dataclasses.replace(known, nxd=nxd)
            if known
            else ModelRow(ep.name, ep.name, "third_party", nxd, reference=False)
        )
    return list(by_name.values())


def check_registered(found: Iterable[importlib.metadata.EntryPoint]) -> dict[str, str | None]:
    """Each registered architecture -> None where its class imports and is an NxDI
    application class (get_neuron_config_cls, get_config_cls), else what is wrong
    (`neuron-plugin doctor`, run in the backend's environment)."""
    problems: dict[str, str | None] = {}
    for ep in found:
        try:
            cls = ep.load()
        except Exception as exc:  # an import error of any kind is the finding
            problems[ep.name] = f"{ep.value} does not import: {type(exc).__name__}: {exc}"
            continue
        application = hasattr(cls, "get_neuron_config_cls") and hasattr(cls, "get_config_cls")
        problems[ep.name] = None if application else f"{ep.value} is not an NxDI application class"
    return problems
