"""Chat completions: the tiny checkpoints ship a chat template (in tokenizer_config.json,
as Hugging Face chat checkpoints do), so `/v1/chat/completions` of a real `vllm serve`
answers without `--chat-template`, plainly, streamed, and under vLLM's own
`vllm bench serve --backend openai-chat`. The server is the session's shared one
(tests/e2e/conftest.py; each start costs about a minute on these machines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from build_tiny_model import CHAT_TEMPLATE
from jinja2 import TemplateError


MESSAGES = [{"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "What does the scheduler do with a request?"}]


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def test_tiny_checkpoints_ship_a_chat_template(model_dirs, tokenizer):
    for path in model_dirs.values():
        config = json.loads((path / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHAT_TEMPLATE
    history = [*MESSAGES, {"role": "assistant", "content": "It batches it."}]
    assert tokenizer.apply_chat_template(history, tokenize=False) == (
        "<|bos|>system\nAnswer in one line.<|endoftext|>\n"
        "user\nWhat does the scheduler do with a request?<|endoftext|>\n"
        "assistant\nIt batches it.<|endoftext|>\n")
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("a request?<|endoftext|>\nassistant\n")
    with pytest.raises(TemplateError, match="role tool is not supported; use system, user "
                                            "or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "42"}], tokenize=False)


@pytest.mark.server
def test_chat_completion_matches_transformers_on_the_templated_prompt(
        client, model_dirs, tokenizer, oracles):
    prompt_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                add_generation_prompt=True)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    expected = oracles("llama").generate(prompt, 8)
    if tokenizer.eos_token_id in expected:  # the reply ends with its turn
        expected = expected[:expected.index(tokenizer.eos_token_id) + 1]
    reply = client.chat.completions.create(model=str(model_dirs["llama"]), messages=MESSAGES,
                                           max_tokens=8, temperature=0.0)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected)
    message = reply.choices[0].message
    assert message.role == "assistant"
    assert message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert message.content


@pytest.mark.server
def test_streamed_chat_equals_unstreamed(client, model_dirs):
    request = dict(model=str(model_dirs["llama"]), messages=MESSAGES, max_tokens=12,
                   temperature=0.0)
    whole = client.chat.completions.create(**request).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**request, stream=True)
              if c.choices]
    pieces = [c.delta.content for c in chunks if c.delta.content]
    assert chunks[0].delta.role == "assistant"
    assert len(pieces) > 1
    assert "".join(pieces) == whole.message.content
    assert [c.finish_reason for c in chunks if c.finish_reason] == [whole.finish_reason]


@pytest.mark.server
def test_vllm_bench_serve_openai_chat_completes_every_request(server, model_dirs,
                                                              tmp_path):
    vllm_cli = Path(sys.executable).with_name("vllm")
    result = subprocess.run(
        [str(vllm_cli), "bench", "serve", "--backend", "openai-chat",
         "--endpoint", "/v1/chat/completions", "--base-url", server.url,
         "--model", str(model_dirs["llama"]), "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "4",
         "--ignore-eos", "--seed", "0", "--disable-tqdm", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "chat.json"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "chat.json").read_text())
    assert (data["completed"], data["failed"]) == (4, 0)
    assert data["total_output_tokens"] == 4 * 8


@pytest.mark.server
def test_an_image_for_a_text_only_model_gets_a_400_and_the_server_keeps_serving(
        server, client, model_dirs):
    """vLLM's own check of a text-only model's inputs answers; nothing reaches the engine."""
    import base64

    import requests

    png = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        {"type": "text", "text": "what is in the picture"}]}]
    response = requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": str(model_dirs["llama"]), "messages": messages, "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert "is not a multimodal model" in response.json()["error"]["message"]
    reply = client.chat.completions.create(model=str(model_dirs["llama"]), messages=MESSAGES,
                                           max_tokens=4, temperature=0.0)
    assert reply.usage.completion_tokens == 4
