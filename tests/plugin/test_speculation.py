"""Speculative decoding below vLLM: settings and refusals, the lookahead-extended decode
grids, the speculative decode inputs, the acceptance rules (NxDI's argmax rule for the
nxd backend, vLLM's rejection sampling in the reference backend's graphs, checked
exactly over a grid of uniform draws), the model runner's drafts with vLLM's own
NgramProposer, and the per-bucket acceptance counters. Through real vLLM engines:
tests/e2e/test_speculative_decoding.py."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

# The platform vLLM activates for EngineArgs below (set before vLLM is imported).
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from neuron_plugin.backends.reference.sampler import candidate_probs, verify  # noqa: E402
from neuron_plugin.core.inputs import PAD_SLOT, token_generation_inputs  # noqa: E402
from neuron_plugin.core.settings import (  # noqa: E402
    EngineLimits,
    NeuronConfigError,
    engine_updates,
    resolve_settings,
)
from neuron_plugin.core.speculation import NO_TOKEN, accepted_tokens, emitted  # noqa: E402

BASE = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                    enable_prefix_caching=False, enable_chunked_prefill=False,
                    max_num_batched_tokens=256, dtype="float32")
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=3)
PREFIX = dict(enable_prefix_caching=True, block_size=32)


def resolve(limits=None, override=None, backend="reference"):
    return resolve_settings(dataclasses.replace(BASE, **(limits or {})), override,
                            backend=backend, architecture="LlamaForCausalLM")


# -- settings ----------------------------------------------------------------------------
def test_ngram_settings_and_what_vllm_is_told():
    settings = resolve(NGRAM)
    assert (settings.speculation_method, settings.num_speculative_tokens) == ("ngram", 3)
    assert settings.speculation_length == 4 and not settings.is_fused_speculation
    # decoding at position 254 verifies 255..258: the grid reaches max_model_len + 3
    assert settings.token_generation_buckets == (128, 256, 259)
    updates = {u.name: u for u in engine_updates(settings)}
    assert updates["async_scheduling"].value is False
    assert "previous step accepted" in updates["async_scheduling"].reason
    assert "async_scheduling" not in {u.name for u in engine_updates(resolve())}


def test_draft_model_settings(tmp_path, model_dirs):
    settings = resolve(dict(speculative_method="draft_model", num_speculative_tokens=2,
                            draft_model=str(model_dirs["llama"])), backend="nxd")
    assert settings.is_fused_speculation and settings.speculation_length == 3
    assert settings.draft_model == str(model_dirs["llama"].resolve())
    with pytest.raises(NeuronConfigError, match=r"model='.*nowhere'.*local checkpoint folder"):
        resolve(dict(speculative_method="draft_model", num_speculative_tokens=2,
                     draft_model=str(tmp_path / "nowhere")))


TARGET_SHAPE = (128, 977, 2)  # tiny-mistral-trained: hidden_size, vocab_size, layers


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_are_fused_drafters(method, eagle_heads):
    head = eagle_heads[1 if method == "eagle" else 2]
    settings = resolve(dict(speculative_method=method, num_speculative_tokens=3,
                            draft_model=str(head), target_shape=TARGET_SHAPE))
    assert settings.is_fused_speculation and settings.is_eagle
    assert settings.speculation_length == 4 and settings.draft_model == str(head.resolve())
    assert settings.token_generation_buckets == (128, 256, 259)  # the lookahead, as for drafts
    # the nxd backend drives NxDI's fused EAGLE speculation (tests/plugin/test_nxd_eagle.py)
    nxd = resolve(dict(speculative_method=method, num_speculative_tokens=3,
                       draft_model=str(head), target_shape=TARGET_SHAPE), backend="nxd")
    assert nxd.is_eagle and nxd.speculation_length == 4


def _head_copy(tmp_path, head, **config):
    """A copy of `head` whose config.json has `config`'s keys changed (None: removed)."""
    import json
    import shutil

    copy = tmp_path / head.name
    shutil.copytree(head, copy)
    data = json.loads((copy / "config.json").read_text())
    data.update(config)
    (copy / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return copy


@pytest.mark.parametrize("method,shape,config,message", [
    ("eagle", (256, 977, 2), {}, r"hidden_size is 128, the target's 256.*shares the target's"),
    ("eagle3", (128, 1000, 2), {}, r"the head's vocab_size is 977, the target's 1000"),
    ("eagle3", (128, 977, 1), {},
     r"eagle_aux_hidden_state_layer_ids \[0, 1, 2\] name layers outside the target's 0..1"),
    ("eagle3", TARGET_SHAPE, {"eagle_aux_hidden_state_layer_ids": None},
     r"\[2, 1, -1\] name layers outside.*default \(2, L // 2, L - 3\) needs at least 4"),
    ("eagle3", TARGET_SHAPE, {"draft_vocab_size": 600},
     r"lm_head.weight is \[512, 128\], its config and the target make it \[600, 128\]"),
    ("eagle3", TARGET_SHAPE, {"norm_before_fc": True}, r"sets norm_before_fc"),
    ("eagle", TARGET_SHAPE, {"num_hidden_layers": 0}, r"num_hidden_layers=0"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_by_name(
        method, shape, config, message, eagle_heads, tmp_path):
    head = eagle_heads[1 if method == "eagle" else 2]
    if config:
        head = _head_copy(tmp_path, head, **config)
    with pytest.raises(NeuronConfigError, match=rf"--speculative-config model=.*{message}"):
        resolve(dict(speculative_method=method, num_speculative_tokens=3,
                     draft_model=str(head), target_shape=shape))


def test_explain_config_names_the_eagle_graphs_and_counts_the_head(eagle_heads):
    import json

    from neuron_plugin.core.instances import INSTANCE_TYPES
    from neuron_plugin.tools import explain

    target, _, head = eagle_heads
    settings = resolve(dict(speculative_method="eagle3", num_speculative_tokens=3,
                            draft_model=str(head), target_shape=TARGET_SHAPE))
    report = explain.build_report(settings, str(target),
                                  json.loads((target / "config.json").read_text()), None,
                                  INSTANCE_TYPES["inf2.xlarge"], "x", (None, "x"))
    spec = report["speculation"]
    assert (spec["method"], spec["speculation_length"]) == ("eagle3", 4)
    assert spec["enable_eagle_speculation"] and spec["is_eagle3"]
    assert "an eagle3 head on the target's hidden states" in spec["summary"]
    assert report["memory"]["draft_kv_cache_per_core_bytes"] > 0  # the head's one layer
    # NxDI's rolling buffer: max_num_seqs x 2 speculation_length x 3 hidden sizes (EAGLE-3)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    states = settings.max_num_seqs * 2 * 4 * 3 * hidden * 4
    assert report["memory"]["eagle_hidden_states_per_core_bytes"] == states
    line = next(x for x in explain.render(report).splitlines() if x.startswith("speculation"))
    assert "enable_eagle_speculation true, is_eagle3 true); head " in line
    assert "and the hidden states it reads " in line


def test_vllms_eagle_config_reaches_the_settings_with_the_targets_shape(eagle_heads):
    """vLLM's own SpeculativeConfig for an EAGLE-3 head: the head folder and the target's
    shape it is checked against come from it."""
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.serving.vllm_settings import engine_limits

    target, _, head = eagle_heads
    config = EngineArgs(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=2,
                        enable_prefix_caching=False, enable_chunked_prefill=False,
                        speculative_config={"method": "eagle3", "model": str(head),
                                            "num_speculative_tokens": 2},
                        ).create_engine_config()
    limits = engine_limits(config)
    assert (limits.speculative_method, limits.draft_model) == ("eagle3", str(head))
    assert limits.target_shape == TARGET_SHAPE


def test_block_layout_grids_reach_the_lookahead_in_whole_blocks():
    settings = resolve({**NGRAM, **PREFIX})
    assert settings.token_generation_buckets[-1] == 288  # 259 rounded up to 32-token blocks
    assert settings.prefix_buckets[-1] == 256  # context encoding does not look ahead


@pytest.mark.parametrize("limits,override,backend,message", [
    (dict(speculative_method="mtp", num_speculative_tokens=2), {}, "reference",
     r"method 'mtp': MTP, DFlash and hidden-state extraction are not compiled"),
    (dict(speculative_method="suffix", num_speculative_tokens=2), {}, "reference",
     r"method 'suffix' is not served on Neuron"),
    (NGRAM, {"on_device_sampling_config": None}, "reference",
     r"with on-device sampling off.*remove on_device_sampling_config: null"),
    ({**NGRAM, **PREFIX}, {}, "nxd", r"with the block KV layout.*use a draft model"),
    (NGRAM, {"token_generation_batches": [1, 2, 4]}, "nxd",
     r"token_generation_batches: NxDI refuses batch bucketing with speculation"),
    (NGRAM, {"token_generation_buckets": [128, 256]}, "reference",
     r"speculation_length=4 reaches max_model_len \+ 3 = 259"),
    ({}, {"speculation_length": 4}, "reference",
     r"speculation_length=4 is not supported: speculative decoding is set with vLLM's "
     r"--speculative-config"),
])
def test_what_cannot_work_is_refused(limits, override, backend, message):
    with pytest.raises(NeuronConfigError, match=message):
        resolve(limits, override, backend)


def test_ngram_in_the_block_layout_is_served_by_the_reference_backend():
    assert resolve({**NGRAM, **PREFIX}).is_block_layout


# -- the call's inputs ----------------------------------------------------------------------
def test_ngram_decode_inputs_carry_drafts_and_budgets():
    settings = resolve(NGRAM)
    inputs = token_generation_inputs(
        settings, np.array([11, 12]), np.array([40, 124]), np.array([2, 0]), None,
        np.array([[5, 6, 7], [8, -1, -1]]), np.array([3, 1]))
    # bucket: need 124 + 1 + 4 = 129 positions, NxDI's attention mask + speculation_length
    assert inputs.bucket == (4, 256)
    assert inputs.input_ids[:2].tolist() == [[11, 5, 6, 7], [12, 8, 0, 0]]
    assert inputs.position_ids[1].tolist() == [124, 125, 126, 127]
    assert inputs.full_context_lens[:2].tolist() == [44, 126]
    assert inputs.computed_context_lens[:2].tolist() == [40, 124]
    assert inputs.draft_budget.tolist() == [3, 1, 0, 0]
    assert inputs.real_tokens == 6 and inputs.padded_tokens == 4 * 4 - 6


def test_fused_decode_inputs_take_one_token_and_slots_for_every_position(model_dirs):
    settings = resolve(dict(speculative_method="draft_model", num_speculative_tokens=3,
                            draft_model=str(model_dirs["llama"]), **PREFIX))
    inputs = token_generation_inputs(
        settings, np.array([11]), np.array([62]), np.array([0]), [[3, 9, 4]], None,
        np.array([2]))
    # one row: the one-row bucket of the default decode batches
    assert inputs.input_ids.shape == (1, 1) and inputs.width == 4
    # positions 62, 63 (block 9) | 64 (block 4), and none past the budget of 2 drafts
    assert inputs.slot_mapping[0].tolist() == [9 * 32 + 30, 9 * 32 + 31, 4 * 32, PAD_SLOT]
    assert inputs.padded_tokens == 1 * 4 - 3


# -- acceptance -------------------------------------------------------------------------
def test_nxdis_argmax_rule_with_budgets():
    drafts = np.array([[5, 6, 7], [5, 9, 7], [5, 6, 7], [1, 2, 3]])
    target = np.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [4, 4, 4, 4]])
    budget = np.array([3, 3, 1, 0])
    tokens = accepted_tokens(drafts, target, budget)
    assert emitted(tokens) == [[5, 6, 7, 8], [5, 6], [5, 6], [4]]
    assert tokens[3].tolist() == [4, NO_TOKEN, NO_TOKEN, NO_TOKEN]


def _verify(logits, drafts, budget, top_k, temperature, uniform, top_p=1.0, candidates=8):
    rows = logits.shape[0]
    return verify(logits, torch.tensor(drafts), torch.tensor(budget),
                  torch.full((rows,), top_k, dtype=torch.int32),
                  torch.full((rows,), top_p), torch.full((rows,), temperature),
                  torch.tensor(uniform, dtype=torch.float32), candidates)


def test_greedy_rows_accept_drafts_equal_to_the_argmax():
    logits = torch.zeros(2, 4, 10)
    for position, best in enumerate([3, 4, 5, 6]):
        logits[:, position, best] = 5.0
    tokens = _verify(logits, [[3, 4, 5], [3, 9, 5]], [3, 3], 1, 1.0, np.zeros((2, 4)))
    assert tokens.tolist() == [[3, 4, 5, 6], [3, 4, NO_TOKEN, NO_TOKEN]]
    capped = _verify(logits[:1], [[3, 4, 5]], [1], 1, 1.0, np.zeros((1, 4)))
    assert capped.tolist() == [[3, 4, NO_TOKEN, NO_TOKEN]]


def test_sampled_rows_keep_the_targets_distribution():
    """vLLM's rejection sampling is exact: over a fine grid of the first position's draw,
    the first emitted token follows the target's distribution at that position whatever
    the draft, and the draft is accepted with its target probability."""
    grid = 4000
    logits = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(3)) * 1.5
    logits = logits.expand(grid, 2, 8).contiguous()
    draws = np.zeros((grid, 2), dtype=np.float32)
    draws[:, 0] = (np.arange(grid) + 0.5) / grid
    draws[:, 1] = 0.37
    probs, ids = candidate_probs(logits[:1, 0], torch.tensor([8]), torch.tensor([0.9]),
                                 torch.tensor([0.8]), 8)
    target = torch.zeros(8).index_add_(0, ids[0], probs[0] / probs.sum())
    for draft in (int(target.argmax()), int(target.argmin())):
        tokens = _verify(logits, [[draft]] * grid, [1] * grid, 8, 0.8, draws, top_p=0.9)
        first = torch.bincount(tokens[:, 0], minlength=8).float() / grid
        assert torch.allclose(first, target, atol=1.5 / grid)
        accepted = (tokens[:, 1] != NO_TOKEN).float().mean()
        assert abs(float(accepted) - float(target[draft])) <= 1.5 / grid


# -- the runner's drafts --------------------------------------------------------------------
@pytest.fixture(scope="module")
def ngram_config(model_dirs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256,
                      max_num_seqs=4, enable_prefix_caching=False,
                      enable_chunked_prefill=False,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 2, "prompt_lookup_max": 3},
                      ).create_engine_config()


def _batch(history: dict[str, list[int]]):
    """vLLM's InputBatch holding requests with these tokens so far."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    batch = InputBatch(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=256,
                       device=torch.device("cpu"), vocab_size=1000, block_sizes=[256],
                       max_num_blocks_per_req=[1], is_pooling_model=False)
    for req_id, tokens in history.items():
        batch.add_request(CachedRequestState(
            req_id=req_id, prompt_token_ids=tokens[:-1], mm_features=[],
            sampling_params=SamplingParams(temperature=0.0), generator=None,
            block_ids=([1],), num_computed_tokens=0, output_token_ids=tokens[-1:],
            lora_request=None))
    return batch


def test_ngram_drafts_come_from_vllms_proposer(ngram_config):
    from neuron_plugin.serving.drafts import Drafts
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    settings = settings_from_vllm_config(ngram_config)
    drafts = Drafts.for_settings(ngram_config, settings)
    batch = _batch({"a": [1, 2, 3, 4, 5, 9, 1, 2, 3], "b": [7, 8, 9, 10]})
    drafts.propose(batch, [[3], [10]], np.array([False, False]))
    proposed = drafts.take()
    assert proposed is not None and proposed.req_ids == ["a", "b"]
    assert proposed.draft_token_ids == [[4, 5, 9], []]
    assert drafts.take() is None  # handed over once

    # what the next call carries: -1 (vLLM's padding) is never a draft to accept
    ids, budget = drafts.scheduled([[4, 5, 9], [-1, -1, -1], [4, 5, 9]],
                                   np.array([False, False, True]))
    assert ids.tolist()[1] == [NO_TOKEN] * 3
    assert budget.tolist() == [3, 0, 0]  # a host row takes no drafts


def test_a_fused_draft_model_gets_placeholders(model_dirs):
    from neuron_plugin.serving.drafts import Drafts

    settings = resolve(dict(speculative_method="draft_model", num_speculative_tokens=2,
                            draft_model=str(model_dirs["llama"])))
    drafts = Drafts(settings)
    batch = _batch({"a": [4, 5, 6], "b": [1, 2], "c": [8, 7]})
    drafts.propose(batch, [[5, 6], [], [7]], np.array([False, False, True]))
    proposed = drafts.take()
    assert proposed.draft_token_ids == [[NO_TOKEN, NO_TOKEN], [], []]
    ids, budget = drafts.scheduled([[-1, -1], [-1]], np.array([False, False]))
    assert ids is None and budget.tolist() == [2, 1]


# -- telemetry ------------------------------------------------------------------------------
def test_per_bucket_counters_count_drafts_and_acceptances():
    from neuron_plugin.serving.telemetry import StepTelemetry

    settings = resolve(NGRAM)
    inputs = token_generation_inputs(settings, np.array([11, 12]), np.array([40, 50]),
                                     np.array([0, 1]), None,
                                     np.array([[5, 6, 7], [8, 9, -1]]), np.array([3, 2]))
    telemetry = StepTelemetry()
    try:
        telemetry.on_backend_call(inputs, 0.01, 0.001, accepted=4)
        row = telemetry.snapshot()["buckets"][0]
        assert (row["draft_tokens"], row["accepted_tokens"]) == (5, 4)
        assert "4/5 drafts accepted (80%, 3.00 tokens a row per call)" in (
            telemetry.summary_lines()[0])
    finally:
        telemetry.close()
