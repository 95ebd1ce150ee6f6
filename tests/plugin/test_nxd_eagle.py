"""EAGLE and EAGLE-3 speculation on the nxd backend against the NxDI double
(tests/plugin/fake_nxdi): NxDI's fused EAGLE speculation (`enable_eagle_speculation`,
`is_eagle3`, the head built as `is_eagle_draft`), driven with the contract's inputs as the
model runner builds them. The real NxDI check is tests/e2e/test_nxdi_eagle.py (0.8, 0.9).

- Greedy output with EAGLE equals greedy output without speculation, batch 1 and > 1,
  both KV layouts (EAGLE-3 contiguous: NxDI asserts it without prefix caching).
- The head as NxDI loads it (nxd.eagle.write_nxdi_head): published heads ship no
  embed_tokens / lm_head (EAGLE) or name their layer `midlayer.` and carry d2t/t2d
  (EAGLE-3); the double drafts right only from NxDI's layout, so acceptance shows it.
- What NxDI's EAGLE cannot compute as vLLM's head is refused by name before compiling.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_plugin.backends.base import graph_specs
from neuron_plugin.backends.loader import cache_manifest
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.backends.nxd.eagle import nxdi_aux_layers
from neuron_plugin.backends.nxd.neuron_config import neuron_config_kwargs, unknown_kwargs
from neuron_plugin.core.inputs import token_generation_inputs
from neuron_plugin.core.settings import NeuronConfigError, resolve_settings
from neuron_plugin.core.speculation import NO_TOKEN
from neuron_plugin.tools.explain import speculation_report
from tests.plugin.test_nxd_speculation import (  # noqa: F401 (fixtures)
    DRAFT_MISS_EVERY,
    DRAFTS,
    K,
    LIMITS,
    PREFIX,
    PROMPTS,
    assert_greedy_equal,
    blocks_of,
    loaded,
    plain_continuations,
    prefill,
    release,
    sampling,
    speculative_histories,
    target,
)

HIDDEN, VOCAB, KV = 256, 977, 128  # the tiny Llama's hidden size, vocabulary, K/V width


def write_head(
    folder: Path,
    method: str,
    target_layers: int,
    *,
    layers: int = 1,
    aux: list[int] | None = None,
    draft_vocab: int = VOCAB,
) -> Path:
    """A head checkpoint as published: EAGLE without embed_tokens and lm_head, EAGLE-3
    with `midlayer.` names, its own lm_head and (with a smaller draft vocabulary) d2t/t2d."""
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM" if method == "eagle" else "LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    small = lambda *shape: torch.full(shape, 0.01)  # noqa: E731
    if method == "eagle":
        tensors = {"fc.weight": small(HIDDEN, 2 * HIDDEN)}
        for i in range(layers):
            tensors |= {
                f"layers.{i}.self_attn.q_proj.weight": small(HIDDEN, HIDDEN),
                f"layers.{i}.self_attn.k_proj.weight": small(KV, HIDDEN),
                f"layers.{i}.post_attention_layernorm.weight": small(HIDDEN),
            }
    else:
        config["draft_vocab_size"] = draft_vocab
        if aux is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux
        tensors = {
            "fc.weight": small(HIDDEN, 3 * HIDDEN),
            "midlayer.self_attn.q_proj.weight": small(HIDDEN, 2 * HIDDEN),
            "midlayer.hidden_norm.weight": small(HIDDEN),
            "norm.weight": small(HIDDEN),
            "lm_head.weight": small(draft_vocab, HIDDEN),
        }
        if draft_vocab != VOCAB:
            tensors |= {
                "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
                "t2d": torch.zeros(VOCAB, dtype=torch.bool),
            }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def deep_target(target, tmp_path) -> Path:
    """The tiny Llama with 8 layers in its config, so NxDI's EAGLE-3 layers (2, 4, 5 in
    vLLM's numbering) are three distinct ones."""
    folder = tmp_path / "deep"
    shutil.copytree(target, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def eagle_settings(
    method: str, head: Path, model: Path, limits: dict | None = None, override: dict | None = None
):
    config = json.loads((model / "config.json").read_text())
    spec = {
        "speculative_method": method,
        "num_speculative_tokens": DRAFTS,
        "draft_model": str(head),
        "target_shape": (config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]),
    }
    return resolve_settings(
        dataclasses.replace(LIMITS, **spec, **(limits or {})),
        override,
        backend="nxd",
        architecture="LlamaForCausalLM",
    )


def heads(tmp_path: Path, target: Path, deep: Path) -> dict[str, tuple[Path, Path]]:
    """method -> (head, its target)."""
    return {
        "eagle": (write_head(tmp_path / "eagle", "eagle", 2), target),
        "eagle3": (write_head(tmp_path / "eagle3", "eagle3", 8), deep),
    }


# -- greedy equality ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,limits",
    [("eagle", {}), ("eagle", PREFIX), ("eagle3", {})],
    ids=["eagle-contiguous", "eagle-block", "eagle3-contiguous"],
)
def test_greedy_output_equals_plain_decoding(
    release, target, deep_target, tmp_path, method, limits
):
    head, model = heads(tmp_path, target, deep_target)[method]
    plain = plain_continuations(model, tmp_path / "plain", 70)
    s = eagle_settings(method, head, model, limits)
    backend = loaded(s, model, tmp_path / "spec")

    def budgets(step: int, seq: int) -> int:
        return (DRAFTS, 0, 1, 2)[(step + seq) % 4]

    def order(step: int) -> list[int]:
        return [[0, 1, 2, 3], [3, 0, 2], [2, 1, 3, 0]][step % 3]

    history = speculative_histories(backend, s, plain, 12, budgets, order)
    assert_greedy_equal(history, plain)
    assert len(history[0]) > len(PROMPTS[0]) + 1 + 12  # drafts accepted
    assert {tag for tag, _ in backend.model.traced_model.ran} == {
        "context_encoding_model",
        "fused_speculation_model",
    }


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_acceptance_needs_the_head_in_nxdis_layout(
    release, target, deep_target, tmp_path, method, monkeypatch
):
    """Batch 1: the head drafts as the double's fused draft (a miss where q % 4 == 0),
    which it does only when NxDI gets the head's folder in its layout (embed_tokens,
    lm_head and fc present) and builds it as an EAGLE draft; the head's folder as
    published gives one token a step."""
    head, model = heads(tmp_path, target, deep_target)[method]

    def counts(folder: Path) -> list[int]:
        s = eagle_settings(method, head, model)
        backend = loaded(s, model, folder)
        history = {0: list(PROMPTS[0])}
        prefill(backend, s, history)
        found = []
        for _ in range(8):
            p = len(history[0]) - 1
            inputs = token_generation_inputs(
                s,
                np.array([history[0][-1]]),
                np.array([p]),
                np.array([0]),
                None,
                None,
                np.array([DRAFTS]),
            )
            row = backend.run(inputs, sampling(1)).tokens[0]
            emitted = row[row != NO_TOKEN].tolist()
            accepted = next((j for j in range(1, K) if (p + j) % DRAFT_MISS_EVERY == 0), K) - 1
            found.append((len(emitted), accepted + 1))
            history[0].extend(emitted)
        return found

    found = counts(tmp_path / "g")
    assert [n for n, _ in found] == [want for _, want in found]
    assert max(n for n, _ in found) == K
    # NxDI handed the published folder: its draft lacks embed_tokens / lm_head
    monkeypatch.setattr(
        "neuron_plugin.backends.nxd.backend.write_nxdi_head",
        lambda head_, source, target_dir, out: Path(source),
    )
    assert {n for n, _ in counts(tmp_path / "raw")} == {1}


# -- what NxDI gets ---------------------------------------------------------------------------
def test_neuron_config_and_the_head_folder(release, target, deep_target, tmp_path):
    from neuronx_distributed_inference.models.config import NeuronConfig

    built = heads(tmp_path, target, deep_target)
    for method, (head, model) in built.items():
        kwargs = neuron_config_kwargs(eagle_settings(method, head, model))
        assert kwargs["enable_eagle_speculation"] is True
        assert kwargs["is_eagle3"] is (method == "eagle3")
        assert kwargs.get("sequence_parallel_enabled", False) is (method == "eagle3")
        assert kwargs["enable_fused_speculation"] is True and kwargs["speculation_length"] == K
        assert unknown_kwargs(NeuronConfig(**dict(kwargs)), kwargs) == []
        backend = NxDBackend(eagle_settings(method, head, model), model)
        app = backend._new_model()  # the head's folder lives as long as the backend
        fused = app.config.fused_spec_config
        assert fused.draft_model_cls is None  # the target's class builds the head
        draft = fused.draft_config.neuron_config
        assert draft.is_eagle_draft is True and draft.speculation_length == K
        assert draft.enable_fused_speculation is False
        assert fused.draft_config.num_hidden_layers == 1
        weights = load_file(str(Path(fused.draft_model_path) / "model.safetensors"))
        shared = load_file(str(model / "model.safetensors"))
        assert torch.equal(weights["embed_tokens.weight"], shared["model.embed_tokens.weight"])
        assert "fc.weight" in weights and "d2t" not in weights
        if method == "eagle":
            assert torch.equal(weights["lm_head.weight"], shared["lm_head.weight"])
        else:  # the head's own lm_head, its layer named as NxDI's model names it
            assert weights["lm_head.weight"].shape == (VOCAB, HIDDEN)
            assert "layers.0.hidden_norm.weight" in weights
            assert not any(k.startswith("midlayer.") for k in weights)
    assert "enable_eagle_speculation" not in neuron_config_kwargs(
        dataclasses.replace(eagle_settings("eagle", *built["eagle"]), speculation_method=None)
    )


def test_cache_key_and_graphs_cover_the_head(release, target, deep_target, tmp_path):
    head, model = heads(tmp_path, target, deep_target)["eagle"]
    eagle = NxDBackend(eagle_settings("eagle", head, model), model)
    fields = eagle.cache_manifest_fields()
    assert fields["model_config"]["speculative_draft"]["hidden_size"] == HIDDEN
    other = write_head(tmp_path / "other", "eagle", 2)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    second = NxDBackend(eagle_settings("eagle", other, model), model)
    assert cache_manifest(second.settings, second) != cache_manifest(eagle.settings, eagle)
    draft_model = NxDBackend(
        dataclasses.replace(eagle.settings, speculation_method="draft_model"), model
    )
    assert cache_manifest(draft_model.settings, draft_model) != cache_manifest(
        eagle.settings, eagle
    )
    # the grid reaches the lookahead (max_model_len + speculation_length - 1), and
    # explain-config reports what NxDI compiles
    assert "tkg_4x259" in {g.name for g in graph_specs(eagle.settings)}
    report = speculation_report(eagle.settings)
    assert report["enable_eagle_speculation"] is True and report["is_eagle3"] is False
    assert report["speculation_length"] == K


# -- refusals ---------------------------------------------------------------------------------
def test_what_nxdis_eagle_cannot_compute_is_refused(release, target, deep_target, tmp_path):
    eagle = write_head(tmp_path / "two-layer", "eagle", 2, layers=2)
    with pytest.raises(NeuronConfigError, match=r"2 decoder layers.*input norm of every layer"):
        NxDBackend(eagle_settings("eagle", eagle, target), target)
    d2t = write_head(tmp_path / "d2t", "eagle3", 8, draft_vocab=512)
    with pytest.raises(NeuronConfigError, match=r"512-token vocabulary.*reads no d2t"):
        NxDBackend(eagle_settings("eagle3", d2t, deep_target), deep_target)
    layers = write_head(tmp_path / "aux", "eagle3", 8, aux=[0, 1, 2])
    assert nxdi_aux_layers(8) == (2, 4, 5)
    with pytest.raises(
        NeuronConfigError,
        match=r"layers \[0, 1, 2\].*NxDI always the inputs "
        r"of layers \[2, 4, 5\]",
    ):
        NxDBackend(eagle_settings("eagle3", layers, deep_target), deep_target)
    shallow = write_head(tmp_path / "shallow", "eagle3", 2, aux=[2, 1, 0])
    with pytest.raises(NeuronConfigError, match=r"three distinct layers need 7 or more"):
        NxDBackend(eagle_settings("eagle3", shallow, target), target)
    eagle3 = write_head(tmp_path / "eagle3", "eagle3", 8)
    with pytest.raises(NeuronConfigError, match=r"asserts EAGLE-3 without prefix caching"):
        NxDBackend(eagle_settings("eagle3", eagle3, deep_target, PREFIX), deep_target)


def test_eagle_with_a_target_nxdi_builds_no_head_for(release, model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    config = json.loads((model / "config.json").read_text())
    head = write_head(tmp_path / "h", "eagle", 2)
    cfg = json.loads((head / "config.json").read_text())
    cfg["hidden_size"] = config["hidden_size"]
    (head / "config.json").write_text(json.dumps(cfg))
    save_file(
        {"fc.weight": torch.zeros(config["hidden_size"], 2 * config["hidden_size"])},
        str(head / "model.safetensors"),
    )
    s = dataclasses.replace(eagle_settings("eagle", head, model), architecture="Qwen3ForCausalLM")
    with pytest.raises(NeuronConfigError, match=r"Qwen3ForCausalLM target.*only its Llama"):
        NxDBackend(s, model)


def test_the_double_asserts_eagle3_without_prefix_caching(release, deep_target, tmp_path):
    """NeuronFusedSpecModel.__init__'s assertion, which the plugin's refusal anticipates."""
    head = write_head(tmp_path / "eagle3", "eagle3", 8)
    s = eagle_settings("eagle3", head, deep_target)
    backend = NxDBackend(s, deep_target)
    app = backend._new_model()
    app.neuron_config.is_prefix_caching = True
    app.config.neuron_config.is_prefix_caching = True
    with pytest.raises(AssertionError, match="EAGLE3 and prefix caching"):
        app.compile(str(tmp_path / "c"))


def test_pad_rows_leave_a_longer_request_alone(release, target, tmp_path):
    """A decode that leaves out a request with a long context (seq_id 1, NxDI's pad row
    in its cache line) must not write into it: NxDI's EAGLE decode clips positions to
    the bucket less speculation_length, so a short batch's pad row would land on cache
    positions the absent request holds (core.inputs runs the largest length then)."""
    head = write_head(tmp_path / "eagle", "eagle", 2)
    prompts = {0: [5, 6, 7], 1: [(3 * i) % 900 + 1 for i in range(150)], 2: [9, 10]}

    def decode(s, backend, steps: int) -> dict[int, list[int]]:
        history = {q: list(p) for q, p in prompts.items()}
        prefill(backend, s, history)
        for step in range(steps):
            seqs = [0, 2] if step < 3 else [0, 1, 2]  # seq 1 sits out three steps
            inputs = token_generation_inputs(
                s,
                np.array([history[q][-1] for q in seqs]),
                np.array([len(history[q]) - 1 for q in seqs]),
                np.array(seqs),
                None,
                None,
                np.zeros(len(seqs), dtype=np.int64),
            )
            out = backend.run(inputs, sampling(len(seqs)))
            for row, q in enumerate(seqs):
                history[q].append(int(out.tokens[row, 0]))
        return history

    plain_settings = resolve_settings(LIMITS, None, backend="nxd", architecture="LlamaForCausalLM")
    plain = decode(plain_settings, loaded(plain_settings, target, tmp_path / "plain"), 6)
    s = eagle_settings("eagle", head, target)
    assert decode(s, loaded(s, target, tmp_path / "spec"), 6) == plain


def test_the_double_fails_eagle3_prefill_without_sequence_parallelism(
    release, deep_target, tmp_path
):
    """NxDI's EAGLE-3 target gathers one of its four hidden sizes for a prefill's last
    position unless sequence parallelism sliced it (measured on real NxDI 0.8 and 0.9,
    tests/e2e/test_nxdi_eagle.py): the plugin compiles EAGLE-3 with it."""
    head = write_head(tmp_path / "eagle3", "eagle3", 8)
    s = eagle_settings("eagle3", head, deep_target, override={"sequence_parallel_enabled": False})
    with pytest.raises(
        NeuronConfigError,
        match=r"sequence_parallel_enabled=False but the nxd "
        r"backend needs True",
    ):
        neuron_config_kwargs(s)
    s = eagle_settings("eagle3", head, deep_target)
    backend = loaded(s, deep_target, tmp_path / "g")
    backend.model.neuron_config.sequence_parallel_enabled = False
    with pytest.raises(RuntimeError, match="einsum"):
        prefill(backend, s, {0: [5, 6, 7]})
