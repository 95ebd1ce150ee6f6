"""Every architecture the nxd backend maps, on real NxD Inference in its CPU mode, through
the plugin's NxDBackend (nxdi_architecture_probe.py), against transformers' greedy tokens
and logits on the same tiny checkpoint (scripts/build_tiny_model.py): contiguous and
block layout at batch 1 and 2, a prefix-cache hit over 128 cached tokens (the (128, 128)
prefill graph) beside a control whose cached blocks hold another prompt (it must differ:
the cache is read), and batch 2 with NxDI's on-device sampler. Prompts are longer than
every sliding window. What NxDI cannot compute as transformers does is refused before
anything compiles, naming the fix (backends/nxd/compat.py); those cases assert the
refusal. The variants: Mistral with a window wider than max_model_len (served as full
attention, both layouts), Gemma3 in the shape NxDI hard-codes (vocabulary 262,208,
every sixth layer global, linear RoPE factor 8) beside the tiny one of another
vocabulary.

Each case runs once per NxDI release listed (NEURON_TEST_NXDI_PYTHONS, see
tests/e2e/conftest.py; the test ids name the release): 0.8 (the release inf2/trn1 run)
lists no Mistral or Gemma3 in MODEL_TYPES; the architecture table serves Mistral there
with 0.8's Llama class and Gemma3 with the module 0.8 ships unlisted (with the gemma3
patches that release needs), and every case is the same as on 0.9. NxD Inference is not
on the package index: without an interpreter these tests skip. One probe process per
architecture and release runs all its cases (about a minute each on two cores)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.e2e.conftest import nxdi_release
from tests.e2e.support import GreedyOracle, corpus_token_ids

pytestmark = [pytest.mark.nxdi]

ARCHS = ["llama", "mistral", "mistral_wide", "mistral_small", "mixtral", "qwen2", "qwen3",
         "qwen3_moe", "qwen3_moe_hub", "dbrx", "gpt_oss", "gemma3", "gemma3_nxdi", "gemma4",
         "gemma4_moe", "gemma4_mm", "qwen3_5", "qwen3_5_moe",
         "qwen3_5_mm"]
STEPS = 8  # decode steps after the prefill's token
MAX_MODEL_LEN = 256
PREFIX = 128  # cached tokens of the prefix-cache hit
OVERRIDE = {"on_cpu": True, "context_encoding_buckets": [32, 64, 128, 256],
            "token_generation_buckets": [64, 128, 256]}
# NxDI's gpt-oss decodes at one length only (nxd families/gpt_oss.py), and the CPU mode
# refuses prefill buckets shorter than its 128-token window (families/llama.py): the
# prompts here are longer than the window anyway and decode in the 256 bucket.
ARCH_OVERRIDE = {
    "GptOssForCausalLM": {"context_encoding_buckets": [128, 256],
                          "token_generation_buckets": [256]},
}
# Logits of NxDI's float32 CPU mode against transformers' (measured up to ~1e-5).
TOLERANCE = 1e-4
# What the backend refuses, by (architecture, layout), on every release: pieces of the
# message ("{release}": the interpreter's NxDI release, e.g. "0.8"). Mistral's block
# layout: with the refusal dropped NxDI fails at the first prefill on 0.8 (its Llama
# class) as on 0.9 (block_kv_cache_manager.py line 299 in both).
REFUSED = {
    ("mistral", "block"): ["sliding_window=16 below max_model_len=256 in the block KV layout",
                           "on NxDI {release}"],
    ("gpt_oss", "block"): ["GptOssForCausalLM on NxDI {release}", "in the block KV layout"],
    # the builder's Qwen3-MoE has a dense layer (mlp_only_layers), NxDI's model none
    ("qwen3_moe", "contiguous"): ["layers [1] have a dense MLP"],
    ("qwen3_moe", "block"): ["layers [1] have a dense MLP"],
    # the plugin's Qwen3.5 class keeps the DeltaNet state in the sequence slot
    ("qwen3_5", "block"): ["(the plugin's own Qwen3.5 class) in the block KV layout",
                           "on NxDI {release}", "--enable-prefix-caching"],
    ("qwen3_5_moe", "block"): ["(the plugin's own Qwen3.5 class) in the block KV layout"],
    ("qwen3_5_mm", "block"): ["(the plugin's own Qwen3.5 class) in the block KV layout"],
}
# Models with per-sequence state (gated DeltaNet layers): their prompts cross the 64-token
# chunks of the chunked delta rule and the prefill buckets (a: 100 tokens, two chunks,
# the 128 bucket; b: 23, inside one chunk, the 32 bucket; c: 230, four chunks, the 256
# bucket), and the probe's staggered and long cases run for them.
STATE_ARCHS = {"qwen3_5", "qwen3_5_moe", "qwen3_5_mm"}
# A state model's prompt r: this token 100 times, so every key of a DeltaNet chunk is
# alike, the ill-conditioned case of the chunk's triangular system. On tiny qwen3_5_moe
# the power-series inverse the class used before put the logits 3.4 off transformers' and
# changed the greedy tokens (token 1: 5.6e-3 off; the dense tiny model stayed within 1e-5).
REPEATED_TOKEN = 5
PROBE = Path(__file__).with_name("nxdi_architecture_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def nxd_settings(arch_name: str, block: bool, tp_degree: int = 1,
                 extra: dict | None = None) -> dict:
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    limits = EngineLimits(max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
                          block_size=32 if block else None, enable_prefix_caching=block,
                          enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN,
                          dtype="float32", tp_degree=tp_degree)
    override = {**OVERRIDE, **ARCH_OVERRIDE.get(arch_name, {}), **(extra or {})}
    return resolve_settings(limits, override, backend="nxd",
                            architecture=arch_name).to_dict()


def probe_prompts(model_dir: Path, config: dict, state: bool = False) -> dict[str, list[int]]:
    """a and b cross the longest window (gpt-oss: 128) and decode past it (a state
    model's: see STATE_ARCHS); c and d share nothing and are long enough for a (128, 128)
    prefix-cache prefill; a state model's r repeats one token 100 times (see
    REPEATED_TOKEN)."""
    window = max([16] + [w for w in [config.get("sliding_window")] if w and w < MAX_MODEL_LEN])
    lengths = (100, 23) if state else (window + 24, window + 7)
    return {"a": corpus_token_ids(model_dir, lengths[0], offset=11),
            "b": corpus_token_ids(model_dir, lengths[1], offset=300),
            "c": corpus_token_ids(model_dir, PREFIX + 102, offset=600),
            "d": corpus_token_ids(model_dir, PREFIX + 102, offset=1200),
            **({"r": [REPEATED_TOKEN] * 100} if state else {})}


@pytest.fixture(scope="module", params=ARCHS)
def probed(request, nxdi_python, tiny_model, tmp_path_factory):
    """(arch, prompts, the probe's report, its logits folder, the oracle) per arch."""
    arch = request.param
    model_dir = tiny_model(arch)
    config = json.loads((model_dir / "config.json").read_text())
    name = config["architectures"][0]
    prompts = probe_prompts(model_dir, config, arch in STATE_ARCHS)
    out = tmp_path_factory.mktemp(f"nxdi-{arch}")
    plan = {"model": str(model_dir), "steps": STEPS, "prefix": PREFIX, "prompts": prompts,
            "layouts": {"contiguous": nxd_settings(name, False),
                        "block": nxd_settings(name, True)},
            "staggered": arch in STATE_ARCHS}
    (out / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([nxdi_python, str(PROBE), str(out / "plan.json"), str(out)],
                          capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return arch, prompts, report, out, GreedyOracle(model_dir), nxdi_release(nxdi_python)


def expect_equal(probed, layout: str, case: str, rows: list[str]) -> None:
    """The case's rows give transformers' greedy tokens, logits within TOLERANCE."""
    arch, prompts, report, out, oracle, _ = probed
    result = report[layout][case]
    logits_file = out / f"{layout}-{case}.npy"
    logits = np.load(logits_file, allow_pickle=False) if logits_file.exists() else None
    for row, key in enumerate(rows):
        tokens, expected = oracle.trace(prompts[key], STEPS + 1)
        assert result["tokens"][row] == tokens, f"{arch} {layout} {case} row {row}"
        if logits is not None:
            ours = torch.from_numpy(logits[row])
            gap = float((ours - expected).abs().max())
            assert gap < TOLERANCE, f"{arch} {layout} {case} row {row}: logits off by {gap}"


def refused_as_expected(probed, layout: str) -> bool:
    """Whether the backend refused `layout` (as REFUSED expects: with those words)."""
    arch, _, report, _, _, release = probed
    wanted = REFUSED.get((arch, layout))
    if wanted is None:
        assert "refused" not in report[layout], report[layout].get("refused")
        return False
    for words in wanted:
        assert words.format(release="{}.{}".format(*release)) in report[layout]["refused"]
    return True


def test_contiguous_layout_equals_transformers_or_is_refused(probed):
    if refused_as_expected(probed, "contiguous"):
        return
    expect_equal(probed, "contiguous", "batch1", ["a"])
    expect_equal(probed, "contiguous", "batch2", ["a", "b"])


def test_state_model_continuous_batching_and_long_prompt(probed):
    """A model with per-sequence state: b prefilled while a decodes (its slot a pad row
    of a's lone decodes, which must leave b's state alone), then both decoded together;
    and a prompt of four DeltaNet chunks: transformers' tokens and logits."""
    arch = probed[0]
    if arch not in STATE_ARCHS:
        pytest.skip("a model without per-sequence state")
    expect_equal(probed, "contiguous", "staggered", ["a", "b"])
    expect_equal(probed, "contiguous", "long", ["c"])


def test_state_model_repeated_token_prompt(probed):
    """One token 100 times: within a DeltaNet chunk every key is the same, where a
    power-series inverse of the chunk's triangular system loses float32's digits
    (backends/gated_delta.py unit_lower_inverse). Transformers' tokens and logits."""
    if probed[0] not in STATE_ARCHS:
        pytest.skip("a model without per-sequence state")
    expect_equal(probed, "contiguous", "repeated", ["r"])


def test_state_model_keeps_its_recurrent_state_float32_through_casts(probed):
    """Cast to bfloat16 as NxDI casts a model, the cache's K/V and convolution states
    follow, its recurrent states stay float32 (as transformers keeps them)."""
    arch, _, report, _, oracle, _ = probed
    if arch not in STATE_ARCHS:
        pytest.skip("a model without per-sequence state")
    from neuron_plugin.core.recurrent_state import state_geometry

    geometry = state_geometry(oracle.model.config.to_dict())
    kv = 2 * len(geometry.attention_layers)
    state = len(geometry.layers)
    expected = ["torch.bfloat16"] * (kv + state) + ["torch.float32"] * state
    assert report["contiguous"]["cast_dtypes"] == expected


def test_block_layout_equals_transformers_or_is_refused(probed):
    if refused_as_expected(probed, "block"):
        return
    expect_equal(probed, "block", "batch1", ["a"])
    expect_equal(probed, "block", "batch2", ["a", "b"])


def test_prefix_cache_hit_reads_the_cached_prefix(probed):
    """A prefill over 128 cached tokens gives transformers' tokens; with another prompt's
    KV in those blocks its logits are far from them (the hit reads the cache: a local
    layer's window may not reach the cached part, the global layers do)."""
    if not refused_as_expected(probed, "block"):
        expect_prefix_hit(probed)


def expect_prefix_hit(probed) -> None:
    """The prefix-hit case equals transformers, and the control's first logits (another
    prompt's KV in the cached blocks) are far from them."""
    arch, prompts, _, out, oracle, _ = probed
    expect_equal(probed, "block", "prefix_hit", ["c"])
    control = torch.from_numpy(np.load(out / "block-prefix_control.npy", allow_pickle=False)[0])
    gap = float((control[0] - oracle.trace(prompts["c"], 1)[1][0]).abs().max())
    assert gap > 100 * TOLERANCE, f"{arch}: another prompt's cached KV moved logits by {gap}"


def test_on_device_sampling_equals_transformers(probed):
    for layout in ("contiguous", "block"):
        if not refused_as_expected(probed, layout):
            expect_equal(probed, layout, "device_sampling", ["a", "b"])
