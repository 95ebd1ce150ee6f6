"""A model class of a third party, registered through the entry-point group
`neuron_plugin.nxdi_models` by a package of this test's own, served by the nxd backend on
real NxD Inference (its CPU mode) and checked as the plugin's own rows are
(test_nxdi_architectures.py's cases: both layouts at batch 1 and 2, a prefix-cache hit
and its control, on-device sampling, against transformers' greedy tokens and logits).

The package subclasses NxDI's Llama application class, as NxDI's contrib models do, under
an architecture name no table row has; the checkpoint is the tiny Llama with that name in
config.json (transformers loads it by model_type). Needs NEURON_TEST_NXDI_PYTHONS (see
tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.e2e.support import GreedyOracle
from tests.e2e.test_nxdi_architectures import (
    PREFIX,
    PROBE,
    ROOT,
    STEPS,
    expect_equal,
    nxd_settings,
    probe_prompts,
)

pytestmark = [pytest.mark.nxdi]

ARCHITECTURE = "TinyContribForCausalLM"
MODULE = '''"""A contrib model class: NxDI's Llama under another architecture name."""

from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM


class NeuronTinyContribForCausalLM(NeuronLlamaForCausalLM):
    """Registered under TinyContribForCausalLM (entry_points.txt)."""
'''


@pytest.fixture(scope="module")
def contrib(tmp_path_factory):
    """A folder with the package and its dist-info (entry point), for PYTHONPATH."""
    folder = tmp_path_factory.mktemp("contrib")
    (folder / "tiny_contrib").mkdir()
    (folder / "tiny_contrib" / "__init__.py").write_text("")
    (folder / "tiny_contrib" / "modeling.py").write_text(MODULE)
    info = folder / "tiny_contrib-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-contrib\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[neuron_plugin.nxdi_models]\n"
        f"{ARCHITECTURE} = tiny_contrib.modeling:NeuronTinyContribForCausalLM\n"
    )
    return folder


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    """The tiny Llama, its config.json naming the contrib architecture."""
    folder = tmp_path_factory.mktemp("tiny-contrib") / "model"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [ARCHITECTURE]}))
    return folder


@pytest.fixture(scope="module")
def probed(nxdi_python, contrib, model, tmp_path_factory):
    config = json.loads((model / "config.json").read_text())
    prompts = probe_prompts(model, config)
    out = tmp_path_factory.mktemp("nxdi-contrib")
    plan = {"model": str(model), "steps": STEPS, "prefix": PREFIX, "prompts": prompts,
            "layouts": {"contiguous": nxd_settings(ARCHITECTURE, False),
                        "block": nxd_settings(ARCHITECTURE, True)}}
    (out / "plan.json").write_text(json.dumps(plan))
    path = [str(contrib), str(ROOT), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "NXD_CPU_MODE": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    done = subprocess.run([nxdi_python, str(PROBE), str(out / "plan.json"), str(out)],
                          capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return "contrib", prompts, report, out, GreedyOracle(model), None


def test_the_registered_class_serves_both_layouts_equal_to_transformers(probed):
    for layout in ("contiguous", "block"):
        assert "refused" not in probed[2][layout], probed[2][layout].get("refused")
        expect_equal(probed, layout, "batch1", ["a"])
        expect_equal(probed, layout, "batch2", ["a", "b"])
        expect_equal(probed, layout, "device_sampling", ["a", "b"])
    expect_equal(probed, "block", "prefix_hit", ["c"])


def test_without_the_entry_point_the_architecture_is_refused(nxdi_python, model, tmp_path):
    """The same checkpoint where the package is not installed: refused, naming the group."""
    probe = (f"from neuron_plugin.backends.nxd.backend import NxDBackend\n"
             f"from neuron_plugin.core.settings import NeuronSettings\n"
             f"settings = NeuronSettings.from_dict({nxd_settings(ARCHITECTURE, False)!r})\n"
             f"NxDBackend(settings, {str(model)!r})\n")
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, "-c", probe], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode != 0
    assert f"{ARCHITECTURE!r} has no NxD Inference model" in done.stderr
    assert "neuron_plugin.nxdi_models" in done.stderr
