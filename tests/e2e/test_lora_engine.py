"""Multi-LoRA through vLLM's offline engine (`LLM`), the backend in this process and the
block KV layout (prefix caching on): adapters a request names without any earlier
add_lora are read when its first step comes (what `LLM.generate(lora_request=...)`
relies on), a batch mixing two adapters and the base model gives PEFT's tokens per row,
prefix-cache blocks are never shared across adapters, and the engine's add/list/pin/
remove_lora reach the worker. The engine also runs the plugin's KV connector (kv_both):
KV a prefill computed for one adapter is refused by a decode request of another (or of
the base model), which computes its prompt itself, so its blocks never enter the prefix
cache under the other's hash."""

from __future__ import annotations

import pytest

from tests.e2e.support import PeftOracle, corpus_token_ids, make_llm, shutdown_llm

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def oracle(model_dirs, lora_adapters) -> PeftOracle:
    return PeftOracle(model_dirs["llama"], lora_adapters)


@pytest.fixture(scope="module")
def llm(model_dirs, tmp_path_factory):
    import json

    from neuron_plugin.core.kv_transfer import connector_config

    kv = tmp_path_factory.mktemp("lora-kv") / "kv"
    llm = make_llm(model_dirs["llama"], enable_prefix_caching=True, block_size=32,
                   enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                   kv_transfer_config=json.loads(connector_config(str(kv))),
                   additional_config={"override_neuron_config": {
                       "context_encoding_buckets": [32, 64, 128, 256]}})
    yield llm
    shutdown_llm(llm)


def _lora(name: str, adapter_id: int, path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, adapter_id, str(path))


def test_unseen_adapters_in_one_batch_with_the_base_model_match_peft(llm, model_dirs,
                                                                     lora_adapters, oracle):
    from vllm import SamplingParams

    shared = corpus_token_ids(model_dirs["llama"], 70, offset=11)  # > 2 KV blocks
    prompts = [shared, shared, corpus_token_ids(model_dirs["llama"], 40, offset=500), shared]
    a = _lora("a", 1, lora_adapters["lora-a"])
    b = _lora("b", 2, lora_adapters["lora-b"])
    requests = [a, None, b, a]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second time, prefix-cache hits within each adapter's blocks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               lora_request=requests, use_tqdm=False)
        names = ["lora-a", None, "lora-b", "lora-a"]
        for prompt, name, out in zip(prompts, names, outputs, strict=True):
            assert list(out.outputs[0].token_ids) == oracle.generate(prompt, MAX_TOKENS, name)
    assert outputs[0].num_cached_tokens > 0  # a's blocks hit for a...
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # ...not base


def test_engine_lora_api_reaches_the_worker(llm, lora_adapters):
    engine = llm.llm_engine
    c = _lora("c", 3, lora_adapters["lora-c"])
    assert engine.add_lora(c)
    assert 3 in engine.list_loras()
    assert engine.pin_lora(3)
    assert engine.remove_lora(3)
    assert 3 not in engine.list_loras()


def test_an_unseen_adapter_that_fails_its_checks_fails_its_request_only(
        llm, model_dirs, lora_adapters, oracle, tmp_path):
    """An adapter read for the first time in a step (offline, never added) that is
    refused there (its lora_B holds NaN) ends its own request with finish reason "error";
    the batch's other rows, with an adapter and without, get PEFT's tokens, and the
    engine serves on."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams

    bad = tmp_path / "nan"
    shutil.copytree(lora_adapters["lora-c"], bad)
    weights = bad / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(weights))
    prompts = [corpus_token_ids(model_dirs["llama"], n, offset=900 + n) for n in (20, 30, 25)]
    requests = [_lora("bad", 7, bad), _lora("b", 2, lora_adapters["lora-b"]), None]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=requests, use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert list(outputs[0].outputs[0].token_ids) == []
    for prompt, name, out in zip(prompts[1:], ["lora-b", None], outputs[1:], strict=True):
        assert list(out.outputs[0].token_ids) == oracle.generate(prompt, MAX_TOKENS, name)
    again = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == oracle.generate(prompts[2], MAX_TOKENS, None)


def test_kv_computed_for_one_adapter_never_serves_another(llm, model_dirs, lora_adapters,
                                                          oracle):
    """Issue 39, case 1: a prompt prefilled with adapter a (do_remote_decode), then decoded
    as the base model with the returned params: the payload is refused (another adapter)
    and the prompt computed here, so the decode and a later plain base-model request of
    the same prompt (which hits the decode's blocks in the prefix cache) get the base
    model's tokens, not tokens from a's KV. The control: decoding the same way with a
    loads a's payload and gets PEFT's lora-a tokens."""
    from vllm import SamplingParams

    a = _lora("a", 1, lora_adapters["lora-a"])

    def prefill(prompt, lora):
        params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={
            "kv_transfer_params": {"do_remote_decode": True}})
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora,
                              use_tqdm=False)
        assert out.kv_transfer_params and out.kv_transfer_params["do_remote_prefill"]
        return out.kv_transfer_params

    def decode(prompt, lora, kv_params=None):
        extra = {"kv_transfer_params": kv_params} if kv_params else None
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                extra_args=extra)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora,
                              use_tqdm=False)
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    prompt = corpus_token_ids(model_dirs["llama"], 80, offset=3100)  # 2 whole blocks + 16
    base = oracle.generate(prompt, MAX_TOKENS, None)
    assert oracle.generate(prompt, MAX_TOKENS, "lora-a") != base  # the adapter matters
    tokens, _ = decode(prompt, None, prefill(prompt, a))
    assert tokens == base
    tokens, cached = decode(prompt, None)  # the base model's blocks of this prompt: a hit
    assert cached == 64 and tokens == base
    # the control: the same adapter takes its payload
    other = corpus_token_ids(model_dirs["llama"], 80, offset=3300)
    assert decode(other, a, prefill(other, a))[0] == oracle.generate(other, MAX_TOKENS,
                                                                      "lora-a")
