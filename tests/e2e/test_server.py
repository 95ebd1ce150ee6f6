"""`vllm serve <tiny> --device neuron` as a real process, driven by the openai client.

The command line is the README's serve command (minus its set-up), so this test also
checks that `--device neuron` parses and selects this platform.
"""

from __future__ import annotations

import pytest
from tests.e2e.support import corpus_token_ids

pytestmark = pytest.mark.server  # the session's server (conftest.py; tests/xdist_schedule.py)

LARGEST_BUCKET = 256


def test_platform_selected_by_device_flag(server):
    log = server.log()
    assert "serving on the CPU reference backend" in log
    assert "KV layout contiguous" in log


def test_serving_processes_set_their_torch_threads(server):
    """The API server computes no model: one thread. The engine core computes the
    reference backend's: the serving rule's count, here the one the session server's
    VLLM_NEURON_TORCH_THREADS gives it (conftest.py), or the rule's own share."""
    import re

    log = server.log()
    assert "torch threads for serving, API server: 1 (the API server: 1" in log
    engine = re.search(r"torch threads for serving, engine core: (\d+) \((.*?);", log)
    assert engine, log[-3000:]
    assert "engine core computing the model" in engine[2] or \
        engine[2].startswith("VLLM_NEURON_TORCH_THREADS=")


def test_completion_matches_transformers(client, model_dirs, oracles):
    prompt = corpus_token_ids(model_dirs["llama"], 40)
    result = client.completions.create(model=str(model_dirs["llama"]), prompt=prompt,
                                       max_tokens=8, temperature=0.0)
    choice = result.choices[0]
    assert result.usage.completion_tokens == 8
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    expected = tokenizer.decode(oracles("llama").generate(prompt, 8))
    assert choice.text == expected


def test_streamed_completion_equals_unstreamed(client, model_dirs):
    prompt = corpus_token_ids(model_dirs["llama"], 20, offset=3)
    whole = client.completions.create(model=str(model_dirs["llama"]), prompt=prompt,
                                      max_tokens=12, temperature=0.0).choices[0].text
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model=str(model_dirs["llama"]), prompt=prompt, max_tokens=12, temperature=0.0,
        stream=True) if chunk.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == whole


def test_prompt_over_largest_bucket_is_rejected_and_server_keeps_serving(client, model_dirs):
    from openai import BadRequestError

    too_long = corpus_token_ids(model_dirs["llama"], LARGEST_BUCKET + 1)
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model=str(model_dirs["llama"]), prompt=too_long,
                                  max_tokens=4)
    message = str(info.value)
    assert info.value.status_code == 400
    assert f"{LARGEST_BUCKET + 1} tokens" in message
    assert f"largest context-encoding bucket holds {LARGEST_BUCKET}" in message

    fits = corpus_token_ids(model_dirs["llama"], LARGEST_BUCKET)
    ok = client.completions.create(model=str(model_dirs["llama"]), prompt=fits,
                                   max_tokens=4, temperature=0.0)
    assert ok.usage.completion_tokens == 4
