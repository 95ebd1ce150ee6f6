"""Defects an audit of NxDI 0.7-0.9 found at the seam, each against the NxDI double
reproducing the real behaviour (tests/plugin/fake_nxdi, whose modules cite the NxDI
source), each failing before its fix:
1. a decode batch's pad rows write into a sliding-window cache line of a request
   prefilled in the same step (the model runner now decodes first);
3. contiguous prefill positions padded as NxDI pads them, so windowed context encoding
   takes padded windows for padding;
5. decode block tables padded with -1 when a token-generation attention kernel skips them;
6. a context-encoding bucket of one token, which NxDI would route to token generation.
Defect 4 (device top-p) and the unmasked prefix prefill are patches: test_patches.py and
test_nxd_backend.py; defect 2 (output_logits gathering every graph's logits) is avoided
by the token-generation logits graphs: test_nxd_logits_graphs.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from neuron_plugin.backends.nxd.arguments import model_arguments
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import NeuronConfigError
from tests.plugin.fake_nxdi.nxdi_release import purge
from tests.plugin.test_nxd_backend import (  # noqa: F401  (fixtures)
    PREFIX,
    expected,
    loaded,
    seam,
    settings,
    tiny,
    use_release,
)

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

WINDOW = 8


# -- 1. sliding-window pad rows -----------------------------------------------------------
@pytest.fixture
def mistral(model_dirs, tmp_path):
    """The tiny Llama as a Mistral checkpoint with an 8-token sliding window."""
    folder = tmp_path / "tiny-mistral"
    shutil.copytree(model_dirs["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral",
                  sliding_window=WINDOW)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def windowed_continuation(prompt: list[int], steps: int) -> list[int]:
    """What the double generates with a sliding window: each query attends the newest
    WINDOW tokens."""
    context = list(prompt)
    for _ in range(steps):
        context.append(expected(context[-WINDOW:]))
    return context[len(prompt):]


def test_1_decode_pad_rows_spare_a_window_prefilled_in_the_same_step(mistral, monkeypatch,
                                                                     tmp_path):
    """Request A decodes in a two-row batch while B (seq_id 1) is prefilled in the same
    step: the pad row for seq_id 1 writes at (max_model_len - 1) % (window - 1) of B's
    rolling line. Run after B's prefill (the old order) it overwrites one of B's window
    keys and B's next token is wrong; the runner runs the decode batch first."""
    from bench_host_overhead import scheduler_output
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from neuron_plugin.serving.model_runner import NeuronModelRunner
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))
    use_release("0.9-ef2731e", monkeypatch, tmp_path)
    config = EngineArgs(
        model=str(mistral), dtype="float32", max_model_len=64, max_num_seqs=2,
        enable_prefix_caching=False, enable_chunked_prefill=False,
        additional_config={"override_neuron_config": {
            "context_encoding_buckets": [16, 32], "token_generation_buckets": [64]}},
    ).create_engine_config()
    try:
        with set_current_vllm_config(config):
            s = dataclasses.replace(settings_from_vllm_config(config), backend="nxd")
            backend = loaded(s, mistral, tmp_path / "graphs")
            runner = NeuronModelRunner(config, s, backend, [])
            rng = np.random.default_rng(3)
            prompts = {"a": rng.integers(5, 900, 12).tolist(),
                       "b": rng.integers(5, 900, 10).tolist()}
            greedy = dict(temperature=0.0, max_tokens=8)

            def new(req_id: str, block: int) -> NewRequestData:
                from vllm import SamplingParams

                return NewRequestData(
                    req_id=req_id, prompt_token_ids=prompts[req_id], mm_features=[],
                    sampling_params=SamplingParams(**greedy), pooling_params=None,
                    block_ids=([block],), num_computed_tokens=0, lora_request=None)

            def step(so) -> dict[str, int]:
                runner.execute_model(so)
                out = runner.sample_tokens(None)
                return {r: out.sampled_token_ids[i][0] for i, r in enumerate(out.req_ids)}

            got = {"a": [], "b": []}
            first = step(scheduler_output(new=[new("a", 1)], scheduled={"a": 12}))
            got["a"].append(first["a"])
            second = step(scheduler_output(
                new=[new("b", 2)],
                cached=CachedRequestData(
                    req_ids=["a"], resumed_req_ids=set(), new_token_ids=[],
                    all_token_ids={}, new_block_ids=[None], num_computed_tokens=[12],
                    num_output_tokens=[1]),
                scheduled={"a": 1, "b": 10}))
            for req_id, token in second.items():
                got[req_id].append(token)
            third = step(scheduler_output(
                cached=CachedRequestData(
                    req_ids=["a", "b"], resumed_req_ids=set(), new_token_ids=[],
                    all_token_ids={}, new_block_ids=[None, None],
                    num_computed_tokens=[13, 10], num_output_tokens=[2, 1]),
                scheduled={"a": 1, "b": 1}))
            for req_id, token in third.items():
                got[req_id].append(token)
    finally:
        purge()
    assert got == {"a": windowed_continuation(prompts["a"], 3),
                   "b": windowed_continuation(prompts["b"], 2)}


# -- 3. contiguous prefill positions ---------------------------------------------------------
@pytest.mark.parametrize("window", [None, 8])
def test_3_prefill_answers_for_its_last_token_with_windowed_context_encoding(
        seam, tiny, tmp_path, window):
    """NxDI takes a window of positions all 1 for padding; pads at 0 made every window
    past the prompt count, and the answer came from a pad."""
    override = {"context_encoding_buckets": [32, 256], "token_generation_buckets": [256],
                "windowed_context_encoding_size": window} if window else None
    s = settings(override=override)
    backend = loaded(s, tiny, tmp_path / "graphs")
    for seq, length in enumerate((1, 2, 5, 9)):
        prompt = list(range(3, 3 + length))
        inputs = context_encoding_inputs(s, np.array(prompt), 0, seq, None)
        assert backend.forward(inputs).argmax(-1).tolist() == [expected(prompt)], length


def test_3_prefill_positions_are_padded_like_nxdi():
    s = settings(override={"windowed_context_encoding_size": 8})
    for prompt, head in (([5, 6, 7], [0, 1, 2, 1, 1]), ([5], [0, 0, 0, 0, 0])):
        args, _ = model_arguments(s, context_encoding_inputs(s, np.array(prompt), 0, 0, None))
        assert args["position_ids"][0, :5].tolist() == head
        assert args["position_ids"][0, 8:].tolist() == [1] * (args["position_ids"].shape[1] - 8)


# -- 5. block tables with a token-generation kernel ---------------------------------------
KERNEL = {"attn_block_tkg_nki_kernel_enabled": True, "qkv_kernel_enabled": True}


@pytest.mark.parametrize("override,pad", [({}, 0), (KERNEL, -1),
                                          ({"attn_tkg_nki_kernel_enabled": True}, -1)])
def test_5_decode_block_tables_are_padded_as_nxdi_pads_them(override, pad):
    s = settings(PREFIX, override)
    inputs = token_generation_inputs(s, np.array([7, 8]), np.array([33, 40]),
                                     np.array([1, 0]), [[3, 6], [1, 2]])
    args, _ = model_arguments(s, inputs)
    assert args["block_table"][:, :3].tolist() == [[1, 2, pad], [3, 6, pad], [3, 6, pad],
                                                   [3, 6, pad]]
    assert (args["block_table"][:, 2:] == pad).all()


@pytest.mark.parametrize("seam", ["0.9"], indirect=True)
def test_5_kernel_graph_gets_the_table_nxdi_would_build(seam, tiny, tmp_path):
    """The graph receives what NxDI's own wrapper builds from the request's blocks alone
    (model_wrapper._pad_prefix_caching_inputs pads them with -1 under the kernel and crops
    to the bucket's blocks), and answers as before."""
    s = settings(PREFIX, KERNEL)
    backend = loaded(s, tiny, tmp_path / "graphs")
    context = np.arange(1, 41)
    backend.forward(context_encoding_inputs(s, context, 0, 0, [3, 6]))
    decode = token_generation_inputs(s, np.array([9]), np.array([40]), np.array([0]), [[3, 6]],
                                     logits=True)  # forward(): the logits twin
    assert backend.forward(decode).argmax(-1).tolist() == [expected([*context, 9])]
    table = backend.model.traced_model.inputs[-1][12]
    blocks = decode.bucket[1] // s.block_size
    assert table.shape[1] == blocks
    assert table[0].tolist() == [3, 6] + [-1] * (blocks - 2)


# -- 6. context-encoding bucket of one token ----------------------------------------------
def test_6_context_encoding_bucket_of_one_is_refused():
    with pytest.raises(NeuronConfigError, match=r"context_encoding_buckets.*\b1\b.*token "
                                                r"generation"):
        settings(override={"context_encoding_buckets": [1, 64, 256]})
