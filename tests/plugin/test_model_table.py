"""The architecture table (neuron_plugin/models) is the one place an architecture is
named: both backends' family modules, the tiny-checkpoint builder and the docs agree with
it, and classes registered under the entry-point group join it."""

from __future__ import annotations

import importlib.metadata
import pkgutil

import pytest

from neuron_plugin.backends.nxd import compat
from neuron_plugin.backends.nxd import families as nxd_families
from neuron_plugin.backends.nxd.support import FEATURES
from neuron_plugin.backends.reference import families as reference_families
from neuron_plugin.core.nxdi_releases import CHECKED
from neuron_plugin.models.render import markdown
from neuron_plugin.models.table import ROWS, TABLE, Refused
from neuron_plugin.models.third_party import ENTRY_POINT_GROUP, with_registered


def modules_of(package) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(package.__path__)}


def test_every_reference_row_has_its_family_and_every_family_its_rows():
    served = {row.architecture: row.family for row in ROWS if row.reference}
    defined = {name: arch.family for name, arch in reference_families.ARCHITECTURES.items()}
    assert defined == served
    assert modules_of(reference_families) == set(reference_families.FAMILIES)
    for row in ROWS:
        if row.vision and row.reference:
            assert callable(reference_families.FAMILIES[row.family].tower), row.architecture


def test_every_row_the_nxd_backend_serves_has_its_family_per_release():
    for row in ROWS:
        served = [r for r in CHECKED if not isinstance(row.nxd.get(r.release), Refused)]
        assert set(row.nxd) == {r.release for r in CHECKED}, row.architecture
        if not served:
            continue
        family = compat.FAMILIES[row.family]
        for release in served:
            assert set(family.support[release.release]) == set(FEATURES), row.architecture
    assert modules_of(nxd_families) == set(compat.FAMILIES)


def test_the_tiny_checkpoints_are_the_tables_and_each_builds_its_architecture():
    """scripts/build_tiny_model.py builds what the table names (its --arch choices), each
    recipe written as its row's architecture, and no recipe outside the table."""
    import build_tiny_model as builder
    from tiny_models import text, vision

    recipes = {**text.ARCHITECTURES, **vision.VISION_LANGUAGE, **vision.OWN_WRITERS}
    assert set(builder.RECIPES) == set(recipes)
    for row in ROWS:
        for name in row.tiny:
            if name in text.ARCHITECTURES:
                assert text.ARCHITECTURES[name]["architectures"] == [row.architecture]


def test_the_docs_print_every_row_and_each_refusal():
    text = markdown()
    for row in ROWS:
        assert f"`{row.architecture}`" in text
        for source in row.nxd.values():
            if isinstance(source, Refused):
                assert source.reason in text


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "TinyContribForCausalLM"])
def test_a_registered_class_takes_its_architectures_row(name):
    ep = importlib.metadata.EntryPoint(name, "contrib.modeling:NeuronTiny", ENTRY_POINT_GROUP)
    rows = {row.architecture: row for row in with_registered(ROWS, [ep])}
    assert len(rows) == len(TABLE) + (name not in TABLE)
    assert {source.describe() for source in rows[name].nxd.values()} == {
        f"contrib.modeling:NeuronTiny (entry point {ENTRY_POINT_GROUP})"
    }
    assert rows[name].reference == (name in TABLE)
    assert "entry point `NeuronTiny`" in markdown(rows.values())


def test_nxdi_0_8_serves_mistral_and_gemma3_with_classes_it_ships():
    """0.8 (inf2/trn1) lists neither in MODEL_TYPES: Mistral takes the Llama class
    (which applies config.sliding_window and reads head_dim; on 0.9 too, whose Mistral
    class ignores head_dim), Gemma3 the module 0.8 ships unlisted; both measured equal to
    transformers (tests/e2e/test_nxdi_architectures.py)."""
    from neuron_plugin.models.table import NxDIModelType, NxDIModule, nxd_architectures

    assert {"MistralForCausalLM", "Gemma3ForCausalLM"} <= set(nxd_architectures("0.8"))
    assert set(TABLE["MistralForCausalLM"].nxd.values()) == {NxDIModelType("llama")}
    assert TABLE["Gemma3ForCausalLM"].nxd["0.8"] == NxDIModule(
        "models.gemma3.modeling_gemma3:NeuronGemma3ForCausalLM")
    rows = {line.split(" | ")[0]: line for line in markdown().splitlines()}
    assert rows["| `MistralForCausalLM`"].endswith(
        "| NxDI `MODEL_TYPES['llama']` | NxDI `MODEL_TYPES['llama']` |")
    assert "NxDI `NeuronGemma3ForCausalLM` (a module it ships unlisted)" in rows[
        "| `Gemma3ForCausalLM`"]
    # refused on 0.8 alone: no architecture
    assert not [line for line in markdown().splitlines() if "refused on NxDI 0.8:" in line]
