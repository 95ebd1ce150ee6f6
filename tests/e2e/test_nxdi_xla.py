"""Every graph the nxd backend compiles, traced as XLA sees it: on real NxD Inference in
its CPU mode, each bucket of each submodel the backend builds (context encoding and token
generation, the token-generation logits twins of backends/nxd/graphs.py, the
prompt-logprob submodel of backends/nxd/prompt_graphs.py, on-device sampling, the block
layout's (active, prefix) cross product with a prefix-cache hit), with the plugin's
patches applied as the backend applies them, replayed on torch-xla's CPU device
(nxdi_xla_probe.py, the recipe of ../shared/nxdi-cpu/README.md): one XLA graph per
bucket (one compile at the sync, none during the forward: a compile there is a host
sync), no device-to-host transfer inside it, a second call with other values compiles
nothing, and every output (tokens or logits, the KV caches, the prompt logprobs) equal to
the eager CPU-mode forward within TOLERANCE. A patch or a model class that breaks any of
these would fail to compile, or compile a graph per value, on a device.

What it cannot show: NxDI's CPU mode builds plain torch where a device has Neuron ops
(RMSNorm, the KV cache's fill_prefix, the sampler's TopK), so the graphs hold no Neuron
custom calls, and TP is 1. It shows that the graph is static, has no host syncs and
computes what the eager forward computes.

Models: every architecture of the table (neuron_plugin/models/table.py) the nxd backend
maps, on its first tiny checkpoint (the same ones test_nxdi_architectures.py serves);
one the table refuses on a release is skipped with the table's reason, a layout the
backend refuses (compat.py) with its message. A vision-language model (Qwen3-VL, Qwen2-VL,
Qwen2.5-VL, Pixtral, Llama 4) runs its VISION_CASES: its text graphs take image inputs
(the patched image merge traced with
served positions and embeddings) and its vision encoder's graphs are replayed too. A class of the plugin's own (a
`PluginClass` row) comes in with its row; a model folder outside the table is one entry
of EXTRA_MODELS. Each model runs one probe process per NxDI release
(NEURON_TEST_NXDI_PYTHONS, tests/e2e/conftest.py) over every case of CASES; without an
interpreter the tests skip."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import nxdi_release

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_xla_probe.py")
ROOT = Path(__file__).resolve().parents[2]
# Outputs of XLA's CPU backend against eager torch's (relative to the output's scale
# where it exceeds 1; measured up to 3e-6 on the tiny checkpoints).
TOLERANCE = 1e-5
# Gemma 4 attends with scaling 1 over RMS-normed queries and keys, so its scores are of
# the order of the head dim and exp() turns float32 rounding of the dot products into
# relative differences of a few 1e-6 per layer: up to 1.2e-5 measured at the fourth
# layer's KV cache (tiny gemma4, a (128, 32) prefix prefill with served values); its
# greedy tokens and logits equal transformers' (test_nxdi_architectures.py).
GEMMA4_TOLERANCE = 5e-5
# Qwen3.5-MoE: each of its six layers adds a routed and a shared expert to the residual
# stream, and float32 rounding reaches 1.24e-5 at the last attention layer's K (tiny
# qwen3_5_moe, the served call of the 128 prefill, 0.8 and 0.9 alike). Both sides are
# float32 rounding of the same sums: against transformers in float64 on that call the
# eager forward is off by 8.2e-6 and the XLA one by 7.6e-6 (transformers' own float32 by
# 4e-5); no routing flips (the top-k gaps are 3.2e-4 and larger, equal on both sides
# within 2e-6).
QWEN3_5_MOE_TOLERANCE = 3e-5
MAX_MODEL_LEN = 160


@dataclass(frozen=True)
class XlaCase:
    """One configuration whose graphs are replayed: its KV layout, its override (small
    grids: each graph compiles in 1-5 s here) and whether prompt logprobs are on."""

    block: bool
    override: Mapping[str, Any]
    prompt_logprobs: bool = True
    max_model_len: int = MAX_MODEL_LEN
    # a vision-language model's processor range: (min patches, max patches, step)
    vision: tuple[int, int, int] | None = None


CASES: dict[str, XlaCase] = {
    # on-device sampling with its logits twin, prompt logprobs, two length buckets each
    "contiguous": XlaCase(
        False, {"context_encoding_buckets": [32, 128], "token_generation_buckets": [64, 160]}
    ),
    # the (active, prefix) cross product of NxDI's prefix caching: (128, 32) is a
    # prefix-cache hit through perform_prefix_prefill (the prefix-prefill-mask patch),
    # (128, 160) one no prompt of max_model_len tokens reaches (compiled all the same)
    "block": XlaCase(
        True,
        {
            "context_encoding_buckets": [128],
            "token_generation_buckets": [160],
            "prefix_buckets": [32, 160],
        },
    ),
    # host sampling: graphs that return logits alone, without NxDI's sampler
    "host-sampling": XlaCase(
        False,
        {
            "context_encoding_buckets": [32],
            "token_generation_buckets": [160],
            "on_device_sampling_config": None,
        },
        prompt_logprobs=False,
    ),
}


def vision_cases(
    vision: tuple[int, int, int], buckets: list[int], host_buckets: list[int]
) -> dict[str, XlaCase]:
    """A vision-language model's cases (an image-to-text application: the contiguous
    layout only, one decode batch size, no prompt logprobs): its text graphs with image
    inputs and its vision encoder's, one per vision bucket (patches per image), within
    its processor range `vision`. The host-sampling case's buckets differ from the
    other's: the same vision graph would come from XLA's cache."""
    return {
        "contiguous": XlaCase(
            False,
            {
                "context_encoding_buckets": [32, 128],
                "token_generation_buckets": [64, 160],
                "max_batch_buckets": 1,
                "vision_buckets": buckets,
            },
            prompt_logprobs=False,
            vision=vision,
        ),
        "host-sampling": XlaCase(
            False,
            {
                "context_encoding_buckets": [32],
                "token_generation_buckets": [160],
                "on_device_sampling_config": None,
                "max_batch_buckets": 1,
                "vision_buckets": host_buckets,
            },
            prompt_logprobs=False,
            vision=vision,
        ),
    }


# By architecture; Qwen3-VL's by default. The tiny Pixtral's images are at most 8 x 8
# patches (image_size 128 of 16-pixel patches), one embedding each.
VISION_CASES: dict[str | None, dict[str, XlaCase]] = {
    None: vision_cases((16, 256, 4), [64, 256], [128]),
    "LlavaForConditionalGeneration": vision_cases((1, 64, 1), [16, 64], [32]),
    # Llama 4's tiny tiles: 16 patches each (4 embeddings)
    "Llama4ForConditionalGeneration": vision_cases((16, 80, 16), [16, 80], [48]),
}


def xla_settings(architecture: str, case: XlaCase) -> dict[str, Any]:
    """The backend's settings for `case`, resolved as the platform resolves them."""
    from neuron_plugin.core.settings import EngineLimits, resolve_settings
    from neuron_plugin.core.vision import VisionLimits

    length = case.max_model_len
    limits = EngineLimits(
        max_model_len=length,
        max_num_seqs=2,
        block_size=32 if case.block else None,
        enable_prefix_caching=case.block,
        enable_chunked_prefill=False,
        max_num_batched_tokens=length,
        dtype="float32",
        tp_degree=1,
        max_logprobs=2,
        vision=VisionLimits(*case.vision) if case.vision else None,
    )
    settings = resolve_settings(
        limits,
        {"on_cpu": True, **case.override},
        backend="nxd",
        architecture=architecture,
        prompt_logprobs=True if case.prompt_logprobs else None,
    )
    return settings.to_dict()


def replay_on_xla(
    python: str,
    model_dir: Path,
    settings: Mapping[str, Mapping[str, Any]],
    out: Path,
    self_check: bool = False,
    timeout: int = 1800,
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """The probe's report for `model_dir` served with each of `settings` (name ->
    NeuronSettings.to_dict()), run under `python` (an interpreter with NxDI and
    torch-xla). The entry point for any architecture, model folder and settings."""
    plan = {
        "model": str(model_dir),
        "cases": dict(settings),
        "self_check": self_check,
        "tolerance": tolerance,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        "NXD_CPU_MODE": "1",
        "PJRT_DEVICE": "CPU",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [python, str(PROBE), str(out / "plan.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


@dataclass(frozen=True)
class XlaModel:
    """A checkpoint to replay: its test id, its folder (built by the tiny_model fixture
    from its name, or given) and the table row it is checked against (None: none)."""

    name: str
    folder: Callable[[Callable[[str], Path]], Path] = field(compare=False)
    architecture: str | None = None
    # override_neuron_config keys of every case for this model
    override: Mapping[str, Any] = field(default_factory=dict)
    tolerance: float = TOLERANCE
    cases: Mapping[str, XlaCase] = field(default_factory=lambda: CASES)


def table_models() -> list[XlaModel]:
    """The first tiny checkpoint of every architecture the nxd backend maps on some
    release (the builder's first Qwen3-MoE has a dense layer the backend refuses: its
    hub-shaped one instead); a vision-language one with VISION_CASES."""
    from neuron_plugin.models.table import ROWS, Refused

    served_instead = {"Qwen3MoeForCausalLM": "qwen3_moe_hub"}
    # gpt-oss: the CPU mode refuses prefill buckets shorter than its 128-token window
    # (nxd families/llama.py short_bucket_problems), and it decodes at one length only
    # (families/gpt_oss.py)
    # gpt-oss and Llama 4 decode at one length only (families/gpt_oss.py, llama4.py)
    overrides = {
        "GptOssForCausalLM": {
            "context_encoding_buckets": [128],
            "token_generation_buckets": [MAX_MODEL_LEN],
        },
        "Llama4ForConditionalGeneration": {"token_generation_buckets": [MAX_MODEL_LEN]},
    }
    tolerances = {
        **dict.fromkeys(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), GEMMA4_TOLERANCE),
        "Qwen3_5MoeForCausalLM": QWEN3_5_MOE_TOLERANCE,
    }
    found = []
    for row in ROWS:
        if not row.tiny or all(isinstance(s, Refused) for s in row.nxd.values()):
            continue
        tiny = served_instead.get(row.architecture, row.tiny[0])
        found.append(
            XlaModel(
                tiny,
                lambda build, tiny=tiny: build(tiny),
                row.architecture,
                overrides.get(row.architecture, {}),
                tolerances.get(row.architecture, TOLERANCE),
                VISION_CASES.get(row.architecture, VISION_CASES[None]) if row.vision else CASES,
            )
        )
    return found


# A model outside the table: XlaModel("name", lambda build: Path(...), None), one line.
# Gemma 4's MoE form, the second tiny checkpoint of its row (the plugin's own class).
EXTRA_MODELS: list[XlaModel] = [
    XlaModel(
        "gemma4_moe",
        lambda build: build("gemma4_moe"),
        "Gemma4ForCausalLM",
        tolerance=GEMMA4_TOLERANCE,
    )
]
MODELS = table_models() + EXTRA_MODELS


@pytest.fixture(scope="module", params=MODELS, ids=[m.name for m in MODELS])
def replayed(request, nxdi_python, tiny_model, tmp_path_factory):
    """(model, the probe's report over CASES) per model and release."""
    model: XlaModel = request.param
    release = "{}.{}".format(*nxdi_release(nxdi_python))
    if model.architecture is not None:
        from neuron_plugin.models.table import TABLE, Refused

        source = TABLE[model.architecture].nxd.get(release)
        if isinstance(source, Refused):
            pytest.skip(f"{model.architecture} on NxDI {release}: {source.reason}")
    from neuron_plugin.core.recurrent_state import state_geometry

    folder = model.folder(tiny_model)
    config = json.loads((folder / "config.json").read_text())
    # a model with per-sequence state has no prompt-logprob graphs (core.settings
    # refuses them: they take no state)
    stateful = state_geometry(config) is not None
    settings = {
        name: xla_settings(
            config["architectures"][0],
            replace(
                case,
                override={**case.override, **model.override},
                prompt_logprobs=case.prompt_logprobs and not stateful,
            ),
        )
        for name, case in model.cases.items()
    }
    out = tmp_path_factory.mktemp(f"xla-{model.name}")
    return (
        model,
        replay_on_xla(nxdi_python, folder, settings, out, tolerance=model.tolerance),
        settings,
    )


def _case(replayed, name: str) -> dict[str, Any]:
    model, report, _ = replayed
    if name not in report["cases"]:
        pytest.skip(f"{model.name}: no {name} case (its cases: {', '.join(report['cases'])})")
    case = report["cases"][name]
    if "refused" in case:
        pytest.skip(f"{model.name} {name}: the backend refuses it: {case['refused']}")
    return case


@pytest.mark.parametrize("name", list(CASES))
def test_every_graph_is_one_static_graph_equal_to_eager(replayed, name):
    case = _case(replayed, name)
    assert case["graphs"], "no graph replayed"
    failing = [f"served call of {error}" for error in case["drive_errors"]] + [
        f"{g['graph']} {g['bucket']}: " + "; ".join(g["problems"])
        for g in case["graphs"]
        if g["problems"]
    ]
    assert not failing, f"{replayed[0].name} {name}:\n" + "\n".join(failing)


@pytest.mark.parametrize("name", list(CASES))
def test_every_graph_the_backend_compiles_is_replayed(replayed, name):
    """Every submodel the features ask for is there, every graph the settings serve was
    replayed with a served call's values, and every bucket NxDI compiles (the block
    layout's whole cross product) was traced."""
    from neuron_plugin.backends.base import graph_specs
    from neuron_plugin.core.settings import NeuronSettings

    case = _case(replayed, name)
    settings = NeuronSettings.from_dict(replayed[2][name])
    expected = {"context_encoding_model", "token_generation_model"}
    if settings.token_generation_logits_shapes():
        expected.add("token_generation_logits_model")
    if settings.prompt_logprobs is not None:
        expected.add("context_encoding_prompt_logprobs_model")
    if settings.vision_buckets:
        expected.add("vision_encoder_model")
    assert set(case["submodels"]) == expected
    served = [g for g in case["graphs"] if g.get("again", {}).get("values") == "served"]
    assert len(served) == len(graph_specs(settings)) == case["served_calls"]
    assert len(case["graphs"]) == case["buckets"]


def test_the_metrics_catch_a_host_sync(nxdi_python, model_dirs, tmp_path):
    """The probe's checks are not vacuous: its own graph with a `.item()` run before the
    lm_head reports the transfer and a compile during the forward (a host sync), where
    the same graph without it reported none."""
    case = XlaCase(
        False,
        {
            "context_encoding_buckets": [32],
            "token_generation_buckets": [64],
            "on_device_sampling_config": None,
        },
        prompt_logprobs=False,
        max_model_len=64,
    )
    settings = {"plain": xla_settings("LlamaForCausalLM", case)}
    report = replay_on_xla(nxdi_python, model_dirs["llama"], settings, tmp_path, self_check=True)
    first = report["cases"]["plain"]["graphs"][0]
    assert not first["problems"]
    synced = report["self_check"]
    assert synced["trace"]["transfers_forward"] >= 1
    assert synced["trace"]["compiles_forward"] >= 1
    assert synced["again"]["transfers_forward"] >= 1
    assert any("host sync" in p for p in synced["trace"]["problems"])
    assert any("device-to-host" in p for p in synced["again"]["problems"])
