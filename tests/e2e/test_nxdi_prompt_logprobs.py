"""Prompt logprobs on real NxD Inference, in NxDI's own CPU mode (the backend driven
directly, nxdi_prompt_logprobs_probe.py): the prompt-logprob submodel NxDI traces from
the plugin's NeuronBaseModel subclass (backends/nxd/prompt_graphs.py) scores every
prompt position as transformers' float32 log-softmax does (top-k ids equal, logprobs
within float tolerance, the target's rank), for two sequences, in the contiguous layout
in one call and in the block layout in 48-token chunks (NxDI re-encodes part of the
cached prefix in front of a chunk; a chunk's last position scores the next chunk's
first token). The tests skip without an interpreter with NxDI (NEURON_TEST_NXDI_PYTHONS,
docs/contributing/testing.md)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.e2e.support import corpus_token_ids, float32_model

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_prompt_logprobs_probe.py")
K = 4


def _probe(python: str, settings, model: Path, prompts: list[list[int]], chunk: int) -> dict:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [python, str(PROBE), json.dumps(settings.to_dict()), str(model), json.dumps(prompts),
         str(chunk)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["contiguous", "block-chunked"])
def test_real_nxdi_prompt_logprobs_equal_transformers(nxdi_python, model_dirs, layout):
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    block = layout == "block-chunked"
    limits = EngineLimits(max_model_len=256, max_num_seqs=2, block_size=32 if block else None,
                          enable_prefix_caching=block, enable_chunked_prefill=block,
                          max_num_batched_tokens=48 if block else 256, dtype="float32",
                          tp_degree=1, max_logprobs=K)
    override = {"on_cpu": True, "context_encoding_buckets": [32, 64, 128],
                "token_generation_buckets": [128, 256]}
    settings = resolve_settings(limits, override, backend="nxd",
                                architecture="LlamaForCausalLM", prompt_logprobs=True)
    model = model_dirs["llama"]
    prompts = [corpus_token_ids(model, 120, offset=11), corpus_token_ids(model, 9, offset=400)]
    report = _probe(nxdi_python, settings, model, prompts, 48 if block else 256)
    assert "context_encoding_prompt_logprobs_model" in report["graphs"]
    hf = float32_model(model)
    for prompt, got in zip(prompts, report["sequences"], strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        targets = torch.tensor(prompt[1:])
        target_logprobs = want.gather(-1, targets[:, None])[:, 0]
        top = want.topk(K, dim=-1)
        ids, values = np.array(got["token_ids"]), np.array(got["logprobs"])
        ranks = np.array(got["ranks"])
        assert ids.shape == (len(prompt) - 1, K + 1)
        assert (ids[:, 0] == prompt[1:]).all()
        assert (ids[:, 1:] == top.indices.numpy()).all()
        np.testing.assert_allclose(values[:, 0], target_logprobs.numpy(), rtol=0, atol=1e-4)
        np.testing.assert_allclose(values[:, 1:], top.values.numpy(), rtol=0, atol=1e-4)
        surely_above = (want > target_logprobs[:, None] + 1e-4).sum(-1).numpy()
        maybe_above = (want >= target_logprobs[:, None] - 1e-4).sum(-1).numpy()
        assert ((surely_above <= ranks) & (ranks <= maybe_above)).all()
        # what crossed the seam: k + 1 ids and values and a rank per scored position
        scored = len(prompt) - 1
        assert sum(c["answer_bytes"] for c in got["calls"]) == scored * (8 * (K + 1) + 8)
    calls = report["sequences"][0]["calls"]
    if block:  # three chunks, the last one's graph rows starting inside the cached prefix
        assert [c["start"] for c in calls] == [0, 48, 96]
        assert calls[-1]["first_row"] < 96
    else:
        assert [(c["start"], c["first_row"]) for c in calls] == [(0, 0)]
