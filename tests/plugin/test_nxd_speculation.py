"""Speculative decoding on the nxd backend against the NxDI double (tests/plugin/fake_nxdi,
NxDI 0.7, 0.8 and 0.9 as published): n-gram drafts through NxDI's speculation model
(contiguous layout) and a fused draft model (both layouts), driven with the contract's
inputs as the model runner builds them (`core.inputs.token_generation_inputs` with
drafts and budgets).

- Greedy output with speculation equals greedy output without it, token for token, with
  rows of different budgets (0 included), a host-sampled row and batches that leave
  seq_ids out (NxDI's pad rows).
- The exact NxDI call of each mode (shapes, mask width, slot mapping, lengths, graph).
- A fused draft's acceptance follows the double's draft exactly, which holds only if
  the draft's KV cache mirrors the target's (context encoding and every step).
- The settings NxDI cannot serve are refused naming the fix; the compile-cache key
  covers a fused draft.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from neuron_plugin.backends.loader import cache_manifest
from neuron_plugin.backends.nxd.arguments import model_arguments, padding_arguments
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.backends.nxd.cpu_mode import requested
from neuron_plugin.backends.nxd.neuron_config import (
    check_speculation_models,
    neuron_config_kwargs,
    unknown_kwargs,
)
from neuron_plugin.backends.base import graph_specs, run_graph_once
from neuron_plugin.backends.nxd.graphs import SPECULATION_LOGITS_TAG
from neuron_plugin.core.inputs import (
    context_encoding_inputs,
    padding_inputs,
    token_generation_inputs,
)
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.speculation import NO_TOKEN
from tests.plugin.fake_nxdi.nxdi_release import load_release, purge

VOCAB = 977
DRAFTS = 3  # num_speculative_tokens: speculation_length 4
K = DRAFTS + 1
DRAFT_MISS_EVERY = 4  # the double's draft (fake_nxdi _nxd_runtime)
LIMITS = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32", tp_degree=2)
PREFIX = {"enable_prefix_caching": True, "block_size": 32}
RELEASES = ["0.7", "0.8", "0.9"]
PROMPTS = {0: [5, 6, 7, 8], 1: [40, 3, 9], 2: [11, 12, 13, 14, 15, 16, 17], 3: [2, 900]}


def settings(method: str | None, draft_dir=None, limits: dict | None = None,
             override: dict | None = None):
    spec = {}
    if method is not None:
        spec = {"speculative_method": method, "num_speculative_tokens": DRAFTS,
                "draft_model": str(draft_dir) if method == "draft_model" else None}
    return resolve_settings(dataclasses.replace(LIMITS, **spec, **(limits or {})), override,
                            backend="nxd", architecture="LlamaForCausalLM")


@pytest.fixture(params=RELEASES)
def release(request, monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "neuronx-cc"))
    load_release(request.param, monkeypatch)
    yield request.param
    purge()


@pytest.fixture
def target(model_dirs):
    return model_dirs["llama"]


@pytest.fixture
def draft(model_dirs):
    """A draft of another architecture with the target's tokenizer (FusedSpecNeuronConfig
    draft_model_cls); the same checkpoint as the target is the vllm-neuron path."""
    return model_dirs["qwen3"]


def loaded(s, model_dir, folder) -> NxDBackend:
    backend = NxDBackend(s, model_dir)
    backend.compile(folder)
    backend.load(folder)
    return backend


def sampling(rows: int, host: np.ndarray | None = None) -> SamplingInputs:
    """Greedy rows (NxDI's encoding: top-k 1); `host` rows get logits back."""
    return SamplingInputs(top_k=np.ones(rows, dtype=np.int32),
                          top_p=np.ones(rows, dtype=np.float32),
                          temperature=np.ones(rows, dtype=np.float32),
                          uniform=np.zeros((rows, K), dtype=np.float32),
                          needs_logits=np.zeros(rows, dtype=bool) if host is None else host)


def blocks_of(s, seq: int) -> list[int] | None:
    """A request's KV blocks: enough for max_model_len, disjoint per sequence."""
    if not s.is_block_layout:
        return None
    count = s.max_blocks_per_seq
    return list(range(1 + seq * count, 1 + (seq + 1) * count))


def prefill(backend, s, history: dict[int, list[int]]) -> None:
    for seq, tokens in history.items():
        inputs = context_encoding_inputs(s, np.array(tokens), 0, seq, blocks_of(s, seq))
        out = backend.run(inputs, sampling(1))
        assert out.tokens.shape[0] == 1
        tokens.append(int(out.tokens[0, 0]))


def plain_continuations(target_dir, folder, length: int) -> dict[int, list[int]]:
    """Greedy histories without speculation (the same double, one token a step)."""
    s = settings(None)
    backend = loaded(s, target_dir, folder)
    history = {seq: list(prompt) for seq, prompt in PROMPTS.items()}
    prefill(backend, s, history)
    while min(len(h) for h in history.values()) < length:
        seqs = sorted(history)
        inputs = token_generation_inputs(
            s, np.array([history[q][-1] for q in seqs]),
            np.array([len(history[q]) - 1 for q in seqs]), np.array(seqs), None)
        out = backend.run(inputs, sampling(len(seqs)))
        for row, seq in enumerate(seqs):
            history[seq].append(int(out.tokens[row, 0]))
    return history


def ngram_drafts(plain: list[int], position: int, step: int) -> list[int]:
    """Up to DRAFTS drafts after `position`: the greedy continuation with every third
    draft wrong, and one row in three proposing fewer (the rest -1, as vLLM pads)."""
    drafts = []
    for j, token in enumerate(plain[position + 1: position + 1 + DRAFTS]):
        drafts.append((token + 1) % VOCAB if (position + j) % 3 == 0 else token)
    if step % 3 == 1:
        drafts = drafts[:1]
    return drafts + [NO_TOKEN] * (DRAFTS - len(drafts))


def speculative_histories(backend, s, plain, steps: int, budgets, order, host_seq=None):
    """Greedy decoding with speculation, checking each step's answer: `budgets(step,
    seq)` the drafts vLLM scheduled, `order(step)` the rows (seq_ids) of the step."""
    history = {seq: list(prompt) for seq, prompt in PROMPTS.items()}
    prefill(backend, s, history)
    for step in range(steps):
        seqs = order(step)
        positions = np.array([len(history[q]) - 1 for q in seqs])
        host = np.array([q == host_seq for q in seqs])
        budget = np.array([0 if q == host_seq else budgets(step, q) for q in seqs])
        drafts = None
        if s.speculation_method == "ngram":
            drafts = np.array([ngram_drafts(plain[q], int(p), step)
                               for q, p in zip(seqs, positions)])
            budget = np.minimum(budget, np.cumprod(drafts >= 0, axis=1).sum(axis=1))
        inputs = token_generation_inputs(
            s, np.array([history[q][-1] for q in seqs]), positions, np.array(seqs),
            [blocks_of(s, q) for q in seqs] if s.is_block_layout else None, drafts, budget)
        out = backend.run(inputs, sampling(len(seqs), host))
        assert out.tokens.shape == (len(seqs), K) and out.tokens.dtype == np.int32
        assert out.logits.shape == (int(host.sum()), VOCAB)
        for row, seq in enumerate(seqs):
            emitted = out.tokens[row][out.tokens[row] != NO_TOKEN].tolist()
            assert (out.tokens[row, len(emitted):] == NO_TOKEN).all()
            assert 1 <= len(emitted) <= budget[row] + 1
            if host[row]:  # the host samples the first position's logits
                emitted = [int(out.logits[int(host[:row].sum())].argmax())]
            history[seq].extend(emitted)
    return history


def assert_greedy_equal(history, plain) -> None:
    for seq, tokens in history.items():
        assert len(tokens) <= len(plain[seq])
        assert tokens == plain[seq][: len(tokens)], seq


# -- greedy equality ------------------------------------------------------------------------
@pytest.mark.parametrize("method,limits", [("ngram", {}), ("draft_model", {}),
                                           ("draft_model", PREFIX)],
                         ids=["ngram", "draft-contiguous", "draft-block"])
def test_greedy_output_equals_plain_decoding(release, target, draft, tmp_path, method, limits):
    plain = plain_continuations(target, tmp_path / "plain", 80)
    s = settings(method, draft, limits)
    backend = loaded(s, target, tmp_path / "spec")

    def budgets(step: int, seq: int) -> int:
        return (DRAFTS, 0, 1, 2)[(step + seq) % 4]

    def order(step: int) -> list[int]:
        # all rows, a batch without seq_id 1 (NxDI's pad row), rows out of seq_id order
        return [[0, 1, 2, 3], [3, 0, 2], [2, 1, 3, 0]][step % 3]

    # a host-sampled row where the configuration has logits (not fused speculation:
    # core.speculation.host_sampling_refusal)
    host_seq = 3 if method == "ngram" else None
    history = speculative_histories(backend, s, plain, 14, budgets, order, host_seq=host_seq)
    assert_greedy_equal(history, plain)
    # speculation paid off: rows with budgets took more than one token a step
    assert len(history[0]) > len(PROMPTS[0]) + 1 + 14
    tags = {tag for tag, _ in backend.model.traced_model.ran}
    # every n-gram step has the host row, so its logits variant runs (graphs)
    generation = ("fused_speculation_model" if method == "draft_model"
                  else SPECULATION_LOGITS_TAG)
    assert tags == {"context_encoding_model", generation}


@pytest.mark.parametrize("limits", [{}, PREFIX], ids=["contiguous", "block"])
def test_draft_of_the_models_own_architecture(release, target, tmp_path, limits):
    """vllm-neuron's path: draft_model_cls None, NxDI builds the draft with the model's
    class. With every budget at its most rows take up to speculation_length tokens a
    step; fewer than the single-row prediction (test_fused_acceptance_follows_the_draft)
    because NxDI's draft mask takes every row's positions for every row
    (`index_fill_` over the batch), so a row behind the others attends stale columns."""
    plain = plain_continuations(target, tmp_path / "plain", 60)
    s = settings("draft_model", target, limits)
    backend = loaded(s, target, tmp_path / "spec")
    assert backend.model.fused_spec_config.draft_model_cls is None
    history = speculative_histories(backend, s, plain, 10, lambda step, seq: DRAFTS,
                                    lambda step: [0, 1, 2, 3])
    assert_greedy_equal(history, plain)
    assert max(len(h) - len(PROMPTS[q]) - 1 for q, h in history.items()) > 2 * 10


# -- the fused draft's acceptance -------------------------------------------------------------
@pytest.mark.parametrize("limits", [{}, PREFIX], ids=["contiguous", "block"])
def test_fused_acceptance_follows_the_draft(release, target, draft, tmp_path, limits):
    """The double's draft misses the token at position q iff q % 4 == 0, given a draft KV
    cache that mirrors the target's: the emitted counts are exactly predictable, and
    only so when the plugin's context encoding and every step fill the draft's cache."""
    s = settings("draft_model", draft, limits)
    backend = loaded(s, target, tmp_path / "spec")
    history = {0: list(PROMPTS[0])}
    prefill(backend, s, history)
    counts = []
    for step, budget in enumerate([3, 3, 1, 2, 0, 3, 3, 2, 3, 1, 3, 3]):
        p = len(history[0]) - 1
        inputs = token_generation_inputs(s, np.array([history[0][-1]]), np.array([p]),
                                         np.array([0]), [blocks_of(s, 0)] if limits else None,
                                         None, np.array([budget]))
        out = backend.run(inputs, sampling(1))
        emitted = out.tokens[0][out.tokens[0] != NO_TOKEN].tolist()
        accepted = next((j for j in range(1, K) if (p + j) % DRAFT_MISS_EVERY == 0), K) - 1
        assert len(emitted) == min(accepted + 1, budget + 1), step
        counts.append(len(emitted))
        history[0].extend(emitted)
    assert {1, 2, 3, 4} <= set(counts)


def test_fused_padding_of_each_release(release, target, draft, tmp_path):
    """NxDI 0.7 pads the accepted tokens with 0, 0.8+ with -1; the count comes from the
    next position ids. Fused speculation is compiled without logits (vllm-neuron's
    configuration; core.speculation.host_sampling_refusal): four outputs."""
    s = settings("draft_model", draft)
    backend = loaded(s, target, tmp_path / "g")
    assert backend.model.neuron_config.output_logits is False
    backend.run(context_encoding_inputs(s, np.array([1, 2, 3]), 0, 0, None), sampling(1))
    inputs = token_generation_inputs(s, np.array([5]), np.array([3]), np.array([0]), None,
                                     None, np.array([DRAFTS]))
    args, _ = model_arguments(s, inputs)
    fused = backend._call(args, inputs.phase, True).fused_outputs
    assert [tuple(t.shape) for t in fused] == [(4, K), (4, 1), (4, 128), (4, 1)]
    count = int(fused[3][0, 0]) - 3
    assert count == 1  # the draft for position 4 misses (4 % 4 == 0)
    pad = 0 if release == "0.7" else -1
    assert fused[0][0, count:].tolist() == [pad] * (K - count)
    out = backend.run(token_generation_inputs(s, np.array([5]), np.array([3]), np.array([0]),
                                              None, None, np.array([DRAFTS])), sampling(1))
    assert out.tokens[0, 1:].tolist() == [NO_TOKEN] * (K - 1)


# -- the NxDI calls ------------------------------------------------------------------------
def test_ngram_call_arguments(release, target, tmp_path):
    s = settings("ngram")
    # NxDI's grid for max_model_len 256, plus the lookahead's reach 259
    assert s.token_generation_buckets == (128, 256, 259)
    backend = loaded(s, target, tmp_path / "g")
    for seq, prompt in ((2, [3, 4, 5]), (0, [6] * 130)):
        backend.run(context_encoding_inputs(s, np.array(prompt), 0, seq, None), sampling(1))
    drafts = np.array([[7, 8, 9], [NO_TOKEN] * 3])
    inputs = token_generation_inputs(s, np.array([5, 6]), np.array([3, 130]),
                                     np.array([2, 0]), None, drafts, np.array([3, 0]))
    # NxDI's rule: mask width 130 + speculation_length 4 < bucket
    assert inputs.bucket == (4, 256)
    args, answer = model_arguments(s, inputs)
    assert answer.tolist() == [2, 0]
    # sorted by seq_id; the missing seq_ids 1 and 3 write at the last position
    assert args["input_ids"].tolist() == [[6, 0, 0, 0], [0, 0, 0, 0], [5, 7, 8, 9],
                                          [0, 0, 0, 0]]
    assert args["position_ids"].tolist() == [[130, 131, 132, 133], [255] * 4, [3, 4, 5, 6],
                                             [255] * 4]
    assert args["attention_mask"].shape == (4, 130)
    assert args["attention_mask"].sum(axis=1).tolist() == [130, 0, 3, 0]
    out = backend.run(inputs, sampling(2))
    call = backend.model.traced_model.inputs[-1]
    assert backend.model.traced_model.ran[-1] == ("speculation_model", 256)
    assert [tuple(t.shape) for t in call[:5]] == [(4, 4), (4, 256), (4, 4), (4,), (4, 3)]
    assert out.logits.shape == (0, VOCAB)
    # a host row: the logits variant (the largest length's, 259), whose tag NxDI adds no
    # lookahead for, so the mask carries it
    logits_args, _ = model_arguments(s, inputs, logits=True)
    assert logits_args["attention_mask"].shape == (4, 134)
    assert (logits_args["attention_mask"][:, 130:] == 0).all()
    out = backend.run(inputs, sampling(2, np.array([False, True])))
    assert backend.model.traced_model.ran[-1] == (SPECULATION_LOGITS_TAG, 259)
    assert out.tokens[1, 1:].tolist() == [NO_TOKEN] * 3  # the host row takes no drafts
    assert out.logits.shape == (1, VOCAB)


def test_ngram_steps_sampled_on_the_device_move_no_logits(release, target, tmp_path):
    """With output_logits NxDI's speculation model returns [batch, speculation_length,
    vocab] float32 logits every call (about 80 MB a step at batch 32, 4 drafts and a
    128k vocabulary). A step whose rows all sample on the device runs it compiled
    without logits; a step with a host row runs its logits variant; both give the same
    tokens."""
    s = settings("ngram")
    outputs = {}
    for host in (False, True):
        backend = loaded(s, target, tmp_path / str(host))
        history = {seq: list(prompt) for seq, prompt in PROMPTS.items()}
        prefill(backend, s, history)
        seqs = sorted(history)
        inputs = token_generation_inputs(
            s, np.array([history[q][-1] for q in seqs]),
            np.array([len(history[q]) - 1 for q in seqs]), np.array(seqs), None,
            np.array([[5, 6, 7]] * 4), np.array([3] * 4))
        out = backend.run(inputs, sampling(4, np.array([False, False, False, host])))
        traced = backend.model.traced_model
        if host:
            assert traced.ran[-1][0] == SPECULATION_LOGITS_TAG
            assert traced.returned[-1]["logits"] == 4 * K * 4 * (VOCAB + VOCAB % 2)
            assert out.logits.shape == (1, VOCAB)
        else:
            assert traced.ran[-1][0] == "speculation_model"
            assert set(traced.returned[-1]) == {"tokens"}
            assert out.logits.shape == (0, VOCAB)
        outputs[host] = out.tokens
    assert (outputs[False][:3] == outputs[True][:3]).all()
    assert s.token_generation_logits_shapes() == [(4, s.token_generation_buckets[-1])]


@pytest.mark.parametrize("limits", [{}, PREFIX], ids=["contiguous", "block"])
def test_fused_call_arguments(release, target, draft, tmp_path, limits):
    s = settings("draft_model", draft, limits)
    backend = loaded(s, target, tmp_path / "g")
    for seq, prompt in ((1, [3, 4, 5]), (3, [6] * 40)):
        backend.run(context_encoding_inputs(s, np.array(prompt), 0, seq, blocks_of(s, seq)),
                    sampling(1))
    table = [blocks_of(s, 1), blocks_of(s, 3)] if s.is_block_layout else None
    inputs = token_generation_inputs(s, np.array([5, 6]), np.array([3, 40]),
                                     np.array([1, 3]), table, None, np.array([2, 0]))
    args, answer = model_arguments(s, inputs)
    assert args["input_ids"].shape == args["position_ids"].shape == (4, 1)
    assert args["seq_ids"].tolist() == [0, 1, 2, 3] and answer.tolist() == [1, 3]
    out = backend.run(inputs, sampling(2))
    assert out.tokens.shape == (2, K)
    assert (out.tokens[1, 1:] == NO_TOKEN).all()  # budget 0: one token
    call = backend.model.traced_model.inputs[-1]
    if not s.is_block_layout:
        assert args["attention_mask"].shape == (4, 40) and "slot_mapping" not in args
        assert backend.model.traced_model.ran[-1] == ("fused_speculation_model", 128)
        assert [tuple(t.shape) for t in call] == [(4, 1), (4, 128), (4, 1), (4,), (4, 3),
                                                  (4,), (4,)]
        return
    # block layout: slots of p..p+3, -1 past each row's budget; one query per row
    assert "attention_mask" not in args
    first, second = blocks_of(s, 1)[0], blocks_of(s, 3)[1]
    assert args["slot_mapping"].tolist() == [
        [-1] * 4, [first * 32 + 3, first * 32 + 4, first * 32 + 5, -1], [-1] * 4,
        [second * 32 + 8, -1, -1, -1]]
    assert args["full_context_lens"].tolist() == [[4], [4], [4], [41]]
    assert args["computed_context_lens"].tolist() == [[3], [3], [3], [40]]
    assert backend.model.traced_model.ran[-1] == ("fused_speculation_model", [1, 128])
    assert len(call) == 11  # NxDI's non-EAGLE fused prefix-caching arguments
    assert tuple(call[7].shape) == (4, K) and tuple(call[8].shape) == (4, 4)
    assert call[9].tolist() == [[1]] * 4


@pytest.mark.parametrize("limits", [{}, PREFIX], ids=["contiguous", "block"])
def test_one_token_prompt(release, target, draft, tmp_path, limits):
    """In the block layout a one-token prompt is a decode at position 0 (NxDI encodes
    only contexts of two tokens or more): NxDI's fused graph answers it; then it decodes."""
    s = settings("draft_model", draft, limits)
    backend = loaded(s, target, tmp_path / "g")
    out = backend.run(context_encoding_inputs(s, np.array([7]), 0, 2, blocks_of(s, 2)),
                      sampling(1))
    first = out.tokens[0][out.tokens[0] != NO_TOKEN].tolist()
    assert first == [7]  # (7 + 1) - 1
    graph = "fused_speculation_model" if limits else "context_encoding_model"
    assert backend.model.traced_model.ran[-1][0] == graph
    inputs = token_generation_inputs(s, np.array([7]), np.array([1]), np.array([2]),
                                     [blocks_of(s, 2)] if limits else None, None,
                                     np.array([DRAFTS]))
    emitted = backend.run(inputs, sampling(1)).tokens[0]
    assert emitted[0] == (8 + 8) - 1


def test_fused_bucket_leaves_room_for_the_lookahead(release, target, draft, tmp_path):
    """A row at position 124 needs 124 + 1 + speculation_length = 129 positions: NxDI
    (mask 124 + 4 < bucket) and the plugin both take the 256 graph, not the 128 one."""
    s = settings("draft_model", draft)
    backend = loaded(s, target, tmp_path / "g")
    prompt = list(np.arange(1, 125) % VOCAB)
    backend.run(context_encoding_inputs(s, np.array(prompt), 0, 0, None), sampling(1))
    inputs = token_generation_inputs(s, np.array([9]), np.array([124]), np.array([0]), None,
                                     None, np.array([DRAFTS]))
    assert inputs.bucket == (4, 256)
    backend.run(inputs, sampling(1))
    assert backend.model.traced_model.ran[-1] == ("fused_speculation_model", 256)


@pytest.mark.parametrize("method,limits", [("ngram", {}), ("draft_model", {}),
                                           ("draft_model", PREFIX)])
def test_padding_only_calls_run_each_graph(release, target, draft, tmp_path, method, limits):
    s = settings(method, draft, limits)
    backend = loaded(s, target, tmp_path / "g")
    for graph in graph_specs(s):
        inputs = padding_inputs(s, graph.phase, graph.shape)
        if graph.phase == "token_generation":  # a stand-in at the bucket's last position
            p = padding_arguments(s, inputs, graph.logits)["position_ids"][0, 0]
            assert p + 1 + K == min(graph.shape[1], s.max_model_len - 1 + K)
        run_graph_once(backend, graph)
        tag, bucket = backend.model.traced_model.ran[-1]
        generation = {"draft_model": "fused_speculation_model",
                      "ngram": SPECULATION_LOGITS_TAG if graph.logits else "speculation_model"}
        assert tag == ("context_encoding_model" if graph.phase == "context_encoding"
                       else generation[method])
        assert np.atleast_1d(bucket)[-1] == graph.shape[-1]


def test_forward_answers_the_first_position(release, target, draft, tmp_path):
    """forward() (warm-up, measurement) gives each row's logits at its last token; a
    fused draft model's graphs have none to give (padding calls still run them)."""
    s = settings("ngram")
    backend = loaded(s, target, tmp_path / "ngram")
    backend.run(context_encoding_inputs(s, np.array([3, 4]), 0, 0, None), sampling(1))
    inputs = token_generation_inputs(s, np.array([7]), np.array([2]), np.array([0]),
                                     None, np.full((1, DRAFTS), 9), np.array([DRAFTS]))
    logits = backend.forward(inputs)
    assert logits.shape == (1, VOCAB)
    assert int(logits.argmax()) == (3 + 4 + 7 + 3 - 1) % VOCAB

    s = settings("draft_model", draft)
    backend = loaded(s, target, tmp_path / "draft")
    for graph in graph_specs(s):  # warm-up's padding calls
        assert backend.forward(padding_inputs(s, graph.phase, graph.shape)).shape == (0, VOCAB)
    backend.run(context_encoding_inputs(s, np.array([3, 4]), 0, 0, None), sampling(1))
    inputs = token_generation_inputs(s, np.array([7]), np.array([2]), np.array([0]), None,
                                     None, np.array([DRAFTS]))
    with pytest.raises(NeuronConfigError, match=r"fused speculation graphs do not return"):
        backend.forward(inputs)


def test_sampled_request_decodes_greedily_under_verification(release, target, draft,
                                                             tmp_path):
    """core.speculation's nxd rule: the first token is sampled with the request's values,
    verification takes the target's argmax at every position."""
    s = settings("draft_model", draft, override={"on_device_sampling_config": {
        "global_topk": 8, "deterministic": True}})
    backend = loaded(s, target, tmp_path / "g")
    rows = SamplingInputs(top_k=np.array([8], dtype=np.int32),
                          top_p=np.ones(1, dtype=np.float32),
                          temperature=np.full(1, 2.0, dtype=np.float32),
                          uniform=np.zeros((1, K), dtype=np.float32),
                          needs_logits=np.zeros(1, dtype=bool))
    out = backend.run(context_encoding_inputs(s, np.array([3, 4]), 0, 0, None), rows)
    first = int(out.tokens[0, 0])
    assert first == (3 + 4 + 2 - 1 + 1) % VOCAB  # the second best: sampled
    out = backend.run(token_generation_inputs(s, np.array([first]), np.array([2]),
                                              np.array([0]), None, None, np.array([DRAFTS])),
                      rows)
    emitted = out.tokens[0][out.tokens[0] != NO_TOKEN].tolist()
    context = [3, 4, first]
    for token in emitted:
        assert token == (sum(context) + len(context) - 1) % VOCAB  # argmax
        context.append(token)


# -- configuration ---------------------------------------------------------------------------
def test_neuron_config_keys(release, target, draft):
    from neuronx_distributed_inference.models.config import NeuronConfig

    ngram = neuron_config_kwargs(settings("ngram"))
    assert ngram["speculation_length"] == K and ngram["enable_fused_speculation"] is False
    assert ngram["on_device_sampling_config"]["dynamic"] is True
    assert ngram["output_logits"] is True
    fused = neuron_config_kwargs(settings("draft_model", draft, PREFIX))
    assert fused["speculation_length"] == K and fused["enable_fused_speculation"] is True
    assert unknown_kwargs(NeuronConfig(**dict(fused)), fused) == []
    assert "speculation_length" not in neuron_config_kwargs(settings(None))


def test_fused_spec_config_is_built_as_vllm_neuron_builds_it(release, target, draft):
    from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaModel
    from neuronx_distributed_inference.models.qwen3.modeling_qwen3 import (
        NeuronQwen3ForCausalLM,
        Qwen3InferenceConfig,
    )

    model = NxDBackend(settings("draft_model", draft, PREFIX), target)._new_model()
    fused = model.config.fused_spec_config
    assert fused.worker_cls is NeuronLlamaModel
    assert fused.draft_model_cls is NeuronQwen3ForCausalLM
    assert fused.draft_model_path == str(draft)
    assert isinstance(fused.draft_config, Qwen3InferenceConfig)
    assert fused.draft_config.num_hidden_layers == 3  # the draft's own config
    draft_neuron = fused.draft_config.neuron_config
    assert draft_neuron.speculation_length == 0
    assert draft_neuron.enable_fused_speculation is False
    assert draft_neuron.pa_num_blocks == model.neuron_config.pa_num_blocks
    assert model.neuron_config.speculation_length == K
    # NxDI builds the fused model and no token-generation model
    assert [m.tag for m in model.models] == ["context_encoding_model",
                                             "fused_speculation_model"]
    assert not hasattr(model, "token_generation_model")
    # and loads the draft's weights beside the target's
    weights = model.checkpoint_loader_fn()
    assert any(k.startswith("draft_model.") for k in weights)
    assert any(k.startswith("target_model.") for k in weights)


def test_one_token_decode_fails_on_nxdis_speculation_model(release, target, tmp_path):
    """NxDI builds no token-generation model next to its speculation model."""
    s = settings("ngram")
    backend = loaded(s, target, tmp_path / "g")
    backend.run(context_encoding_inputs(s, np.array([3, 4]), 0, 0, None), sampling(1))
    with pytest.raises(AttributeError, match="token_generation_model"):
        backend.model(torch.tensor([[5]] * 4), attention_mask=torch.ones(4, 2),
                      position_ids=torch.tensor([[2]] * 4), seq_ids=torch.arange(4))


def test_cache_manifest_covers_the_draft(release, target, draft, tmp_path):
    plain = NxDBackend(settings(None), target)
    fused = NxDBackend(settings("draft_model", draft), target)
    fields = fused.cache_manifest_fields()
    assert fields["model_config"]["speculative_draft"]["num_hidden_layers"] == 3
    assert "speculative_draft" not in plain.cache_manifest_fields()["model_config"]
    manifest = cache_manifest(fused.settings, fused)
    assert "draft_model" not in manifest["neuron"]  # the folder's path: no graph
    assert manifest != cache_manifest(plain.settings, plain)
    same = NxDBackend(settings("draft_model", target), target)
    assert cache_manifest(same.settings, same) != manifest
    embedded = {"save_sharded_checkpoint": True}
    with_draft = NxDBackend(settings("draft_model", draft, override=embedded), target)
    without = NxDBackend(settings(None, override=embedded), target)
    assert len(with_draft.cache_manifest_fields()["weights_fingerprint"]) == 64
    assert (with_draft.cache_manifest_fields()["weights_fingerprint"]
            != without.cache_manifest_fields()["weights_fingerprint"])
    assert fused._record()["draft_architecture"] == "Qwen3ForCausalLM"
    assert plain._record()["draft_architecture"] is None


def test_sharded_checkpoint_embeds_the_draft(release, target, draft, tmp_path):
    s = settings("draft_model", draft, override={"save_sharded_checkpoint": True})
    backend = loaded(s, target, tmp_path / "g")
    keys = backend.model.loaded_weights[0].keys()
    assert any(k.startswith("draft_model.") for k in keys)


def test_load_backend_through_the_compile_cache(release, target, draft, tmp_path):
    from neuron_plugin.backends.loader import load_backend

    s = settings("draft_model", draft, PREFIX)
    backend, first = load_backend(s, target, str(tmp_path / "cache"))
    assert not first.hit
    _, second = load_backend(s, target, str(tmp_path / "cache"))
    assert second.hit and second.key == first.key
    out = backend.run(context_encoding_inputs(s, np.array([4, 5]), 0, 0, blocks_of(s, 0)),
                      sampling(1))
    assert out.tokens.tolist() == [[(4 + 5 + 2 - 1) % VOCAB]]


# -- refusals ---------------------------------------------------------------------------------
def test_cpu_mode_refuses_speculation(draft):
    with pytest.raises(NeuronConfigError, match=r"on_cpu=true.*--speculative-config method "
                                                r"'ngram'.*Speculation is not yet supported"
                                                r".*remove --speculative-config"):
        requested(settings("ngram", override={"on_cpu": True}, limits={"tp_degree": 1}))
    with pytest.raises(NeuronConfigError, match="'draft_model'"):
        requested(settings("draft_model", draft, override={"on_cpu": True},
                           limits={"tp_degree": 1}))


def test_do_sample_is_refused():
    s = settings("ngram", override={"on_device_sampling_config": {"do_sample": True}})
    with pytest.raises(NeuronConfigError, match=r"do_sample=true with --speculative-config"
                                                r".*remove do_sample"):
        neuron_config_kwargs(s)


def test_context_encoding_bucket_of_speculation_length_is_refused():
    s = settings("ngram", override={"context_encoding_buckets": [4, 128, 256]})
    with pytest.raises(NeuronConfigError, match=r"context_encoding_buckets contains 4.*"
                                                r"use other context_encoding_buckets"):
        neuron_config_kwargs(s)


def test_sliding_window_and_foreign_vocabulary_are_refused():
    s = settings("ngram")
    with pytest.raises(NeuronConfigError, match=r"sliding_window=16.*remove "
                                                r"--speculative-config"):
        check_speculation_models(s, {"vocab_size": 977, "sliding_window": 16}, None)
    check_speculation_models(s, {"vocab_size": 977, "sliding_window": 16,
                                 "use_sliding_window": False}, None)
    with pytest.raises(NeuronConfigError, match=r"vocabulary has 1000 tokens, the model's "
                                                r"977.*same family"):
        check_speculation_models(s, {"vocab_size": 977}, {"vocab_size": 1000})


@pytest.mark.parametrize("release", ["0.8"], indirect=True)
def test_nxdi_refuses_batch_bucketing_with_speculation(release):
    from neuronx_distributed_inference.models.config import NeuronConfig

    with pytest.raises(ValueError, match=r"speculative decoding \(self.speculation_length=4"):
        NeuronConfig(batch_size=4, tkg_batch_size=4, speculation_length=4,
                     token_generation_batches=[2, 4])
