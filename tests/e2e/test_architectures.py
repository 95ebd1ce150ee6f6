"""Every architecture the nxd backend maps, served on the reference backend, greedy tokens
equal to transformers' on the same tiny checkpoint (scripts/build_tiny_model.py).

- Sliding windows are 16 tokens and prompts 20-90 tokens, so windowed layers (Mistral,
  Gemma3's and Gemma 4's local layers, gpt-oss's even layers) drop keys on every
  request; Gemma 4's shared layers read their sources' keys from the cache. gpt-oss as
  openai ships it (MXFP4 experts, a 128-token window) is in the decoder check; vLLM
  serves that format in bfloat16 only, whose rounding alone flips a tiny random model's
  greedy tokens (transformers' own bfloat16 does), so engines serve gpt-oss with float
  experts.
- Six concurrent requests for four sequence slots: decode batches with pad rows, slots
  freed and reused by waiting requests (continuous batching).
- Contiguous layout through `vllm serve --device neuron` (one server per architecture);
  block layout with prefix caching through the offline engine, twice over the same
  prompts so the second round reads its prefixes from the cache, also with the backend
  in the SDK-pinned environment's runner for Gemma3 and gpt-oss.
- A fast check without an engine: the decoder's logits against transformers' logits, at
  a tolerance that a window off by one or a missed norm, bias or sink would exceed.

Llama 4's text model is in the decoder check (tests/e2e/test_language_model_only.py serves it).
DBRX, also mapped, is not served by the reference backend (see architectures.py). What the
nxd backend computes per architecture is checked on real NxDI instead
(test_nxdi_architectures.py): the reference follows transformers, not NxDI.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.support import (
    GreedyOracle,
    Server,
    corpus_token_ids,
    float32_model,
    make_llm,
    shutdown_llm,
)

# gpt-oss as openai ships it (MXFP4 experts, "gpt_oss") runs in bfloat16 only through
# vLLM (GptOssMxfp4Config), so the engines serve the float-expert variant; the decoder
# check reads both.
ARCHS = ["mistral", "qwen2", "mixtral", "qwen3_moe", "gemma3", "gemma4", "gpt_oss_float"]
PROMPT_LENGTHS = [20, 33, 47, 60, 70, 90]
NEW_TOKENS = 12
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 128
BUCKETS = {"context_encoding_buckets": [32, 64, 128], "token_generation_buckets": [128]}
BLOCK_SIZE = 32


def _prompts(model_dir: Path) -> list[list[int]]:
    return [corpus_token_ids(model_dir, n, offset=7 * n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(tiny_model):
    """arch -> transformers' greedy continuations of the prompts (computed once)."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            oracle = GreedyOracle(tiny_model(arch))
            cache[arch] = [oracle.generate(p, NEW_TOKENS) for p in _prompts(tiny_model(arch))]
        return cache[arch]

    return get


# llama4: Llama4ForConditionalGeneration's text model (chunks of 16 tokens, NoPE layers);
# served by tests/e2e/test_language_model_only.py (vLLM's Llama 4 module needs torchvision).
@pytest.mark.parametrize("arch", ["llama", "qwen3", *ARCHS, "gpt_oss", "llama4", "gemma4_moe"])
def test_decoder_logits_match_transformers(arch, tiny_model):
    """Prefill 40 tokens (8 past the longest window), then 8 greedy decode steps on one
    cache line."""
    import torch

    from neuron_plugin.backends.reference.decoder import (
        DecoderSpec,
        decoder_graph,
        load_weights,
        rope_tables,
    )
    from neuron_plugin.core.checkpoint import read_hf_config

    model_dir = tiny_model(arch)
    config = read_hf_config(model_dir)
    spec = DecoderSpec.from_hf_config(config)
    graph = decoder_graph(spec, rope_tables(config, spec))
    weights = load_weights(model_dir, spec, torch.float32)
    hf = float32_model(model_dir)
    # 40 tokens, or more where a window is longer (gpt-oss: 128), so every window slides
    n = max([40] + [w + 8 for w in spec.windows if w])
    width = n + 24
    rows, kv_heads, head_dim = spec.cache_geometry
    cache = torch.zeros(rows, width, kv_heads, head_dim)
    k_cache, v_cache = cache, cache.clone()
    slots = torch.arange(width).unsqueeze(0)

    def t(*values: int) -> torch.Tensor:
        return torch.tensor(values)

    ids = torch.tensor([corpus_token_ids(model_dir, n, offset=5)])
    ours = graph(weights, ids, slots[:, :n], slots[:, :n], slots, t(n), t(n - 1), k_cache,
                 v_cache)
    with torch.no_grad():
        theirs = hf(ids, use_cache=True)
        for step in range(9):
            torch.testing.assert_close(ours[0], theirs.logits[0, -1], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, step=step: f"step {step}: {m}")
            token = int(theirs.logits[0, -1].argmax())
            pos = n + step
            ours = graph(weights, t(token).view(1, 1), t(pos).view(1, 1), t(pos).view(1, 1),
                         slots, t(pos + 1), t(0), k_cache, v_cache)
            theirs = hf(t(token).view(1, 1), past_key_values=theirs.past_key_values,
                        use_cache=True)


@pytest.mark.parametrize("architecture, model_type, fields", [
    ("Gemma3ForCausalLM", "gemma3_text", {"sliding_window_pattern": 3}),
    ("GptOssForCausalLM", "gpt_oss", {}),
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": True, "max_window_layers": 4}),
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False}),
    ("Qwen3MoeForCausalLM", "qwen3_moe", {"use_sliding_window": True}),
    ("MistralForCausalLM", "mistral", {}),
    ("MixtralForCausalLM", "mixtral", {}),
], ids=lambda v: v if isinstance(v, str) and v.endswith("CausalLM") else "")
def test_layer_windows_follow_transformers(architecture, model_type, fields):
    """Hub-style configs without layer_types: each layer's window as transformers derives
    it (layer_types where the model reads them, else every layer)."""
    from transformers import AutoConfig

    from neuron_plugin.backends.reference.architectures import layer_windows
    from neuron_plugin.backends.reference.families import ARCHITECTURES

    raw = {"num_hidden_layers": 7, "sliding_window": 16, **fields}
    config = AutoConfig.for_model(model_type, **raw)
    arch = ARCHITECTURES[architecture]
    types = getattr(config, "layer_types", None) if arch.reads_layer_types else None
    wanted = tuple(config.sliding_window if types is None or t == "sliding_attention" else None
                   for t in types or [None] * 7)
    assert layer_windows(arch, raw, 7) == wanted


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tiny_model, tmp_path_factory):
    """`vllm serve models/tiny-<arch> --device neuron`, contiguous layout (the default).
    The platform must be chosen by `--device neuron` alone."""
    arch = request.param
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    server = Server(tiny_model(arch), tmp_path_factory.mktemp(f"serve-{arch}") / "serve.log",
                    ["--max-model-len", str(MAX_MODEL_LEN),
                     "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--additional-config", json.dumps({"override_neuron_config": BUCKETS})],
                    env=env)
    try:
        server.wait_healthy()
        yield arch, server
    finally:
        server.stop()


@pytest.mark.server
def test_served_greedy_matches_transformers(served, tiny_model, expected):
    import requests

    arch, server = served
    model_dir = tiny_model(arch)

    def complete(prompt: list[int]) -> list[int]:
        reply = requests.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": str(model_dir), "prompt": prompt, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        assert reply.ok, reply.text
        return reply.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
        got = list(pool.map(complete, _prompts(model_dir)))
    assert "KV layout contiguous" in server.log()
    assert got == expected(arch)


@pytest.mark.engine
@pytest.mark.parametrize("arch, in_sdk", [
    *((arch, False) for arch in ARCHS),
    # The backend in a runner process in the SDK-pinned environment (torch 2.9,
    # transformers 4.57), for the architectures whose config keys differ between the
    # transformers majors (RoPE per layer type; YaRN).
    # Gemma 4 there too: that transformers has no Gemma 4 (config.json is read as JSON).
    ("gemma3", True), ("gpt_oss_float", True), ("gemma4", True),
], ids=lambda v: {True: "sdk", False: "in-process"}.get(v, v))
def test_block_layout_prefix_cache_matches_transformers(arch, in_sdk, request, tiny_model,
                                                        expected):
    from vllm import SamplingParams

    model_dir = tiny_model(arch)
    runner = {"backend_python": request.getfixturevalue("sdk_python")} if in_sdk else {}
    llm = make_llm(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                   enable_prefix_caching=True, block_size=BLOCK_SIZE,
                   additional_config={"override_neuron_config": BUCKETS, **runner})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in _prompts(model_dir)]
        for round_ in ("cold", "warm"):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected(arch), round_
        # The second round read every full block of its prompt from the prefix cache.
        hits = [o.num_cached_tokens for o in outputs]
        assert all(h >= BLOCK_SIZE * ((n - 1) // BLOCK_SIZE)
                   for h, n in zip(hits, PROMPT_LENGTHS, strict=True)), hits
    finally:
        shutdown_llm(llm)
