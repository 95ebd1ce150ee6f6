"""The NxDI patch registry against the NxDI double's releases (0.7, 0.8 and 0.9 as
published, and the ef2731e sync that fixed the adapter's tensor_capture_hook): each probe
tells defective from fixed code, each fix makes the real call path work, and applying is
idempotent and switchable. No NxDI release fixes the other defects; their probes'
negative side is shown on a hypothetical fix written here."""

from __future__ import annotations

import logging

import pytest
import torch

from neuron_plugin.backends.nxd.work_dir import compile_work_dir
from neuron_plugin.patches import (
    DISABLE_ENV,
    PATCHES,
    adapter_inputs,
    apply_patches,
    bucket_fit,
    cpu_captured_offset,
    disabled_patches,
    prefix_lens,
    prefix_prefill_mask,
    sampler_top_p,
)
from neuron_plugin.patches.base import code_mentions, replace_method, unpatched
from tests.plugin.fake_nxdi.nxdi_release import load_release, purge
from tests.plugin.test_gemma3_patches import hypothetically_fixed as gemma3_fixed

VOCAB = 977  # the tiny checkpoints' vocabulary
NAMES = [p.name for p in PATCHES]
# release -> names of the patches whose defect it has (read in each release's source)
EVERY_RELEASE = {"adapter-prefix-lens", "cte-exact-bucket", "prefix-prefill-mask",
                 "sampler-top-p"}
# Gemma3 (models/gemma3: shipped from 0.8, listed from 0.9) has four defects in each of
# 0.8 and 0.9, three shared (test_gemma3_patches.py); outside NxD's CPU mode, as here.
GEMMA3 = {"gemma3-config", "gemma3-rope", "gemma3-window", "gemma3-norms"}
GEMMA3_0_8 = {"gemma3-config", "gemma3-rope", "gemma3-window", "gemma3-scale"}
# 0.7 and 0.8: NxDI's CPU mode asks text models for a method only image models define.
DEFECTS = {
    "0.7": {"adapter-forward-kwargs", "cpu-captured-offset", *EVERY_RELEASE},
    "0.8": {"adapter-forward-kwargs", "cpu-captured-offset", *EVERY_RELEASE, *GEMMA3_0_8},
    "0.9": {"adapter-forward-kwargs", *EVERY_RELEASE, *GEMMA3},
    "0.9-ef2731e": EVERY_RELEASE | GEMMA3,
}
PUBLISHED = ["0.7", "0.8", "0.9"]


@pytest.fixture
def nxdi(request, monkeypatch):
    monkeypatch.delenv("NXD_CPU_MODE", raising=False)  # gemma3-cpu-norm: CPU mode only
    yield load_release(request.param, monkeypatch)
    purge()


def build_model(nxdi, model_dir, folder, **overrides):
    """An NxDI Llama compiled into `folder` and loaded, as a user of NxDI would."""
    from neuronx_distributed_inference.models.config import NeuronConfig
    from neuronx_distributed_inference.models.llama.modeling_llama import (
        NeuronLlamaForCausalLM,
    )

    kwargs = dict(tp_degree=1, batch_size=2, seq_len=64, max_context_length=64,
                  torch_dtype="float32", enable_bucketing=True, is_continuous_batching=True,
                  context_encoding_buckets=[8, 64], token_generation_buckets=[16, 64])
    kwargs.update(overrides)
    config = NeuronLlamaForCausalLM.get_config_cls()(
        NeuronConfig(**kwargs),
        load_config=nxdi.hf_adapter.load_pretrained_config(str(model_dir)))
    model = NeuronLlamaForCausalLM(str(model_dir), config)
    # NxD's default work folder is one per host: a test on the other worker compiling at
    # the same time would overwrite its graphs (what the backend's own compile avoids)
    with compile_work_dir():
        model.compile(str(folder))
    model.load(str(folder))
    return model


def greedy_continuation(prompt: list[int], steps: int) -> list[int]:
    """What the double generates: each token is (sum of (token + 1) over the context,
    minus 1) mod vocab."""
    context = list(prompt)
    for _ in range(steps):
        context.append((sum(context) + len(context) - 1) % VOCAB)
    return context


def hypothetically_fixed(modules, monkeypatch) -> None:
    """An NxDI whose adapter passes prefix-caching context lengths, whose context
    encoding takes a bucket equal to the context, whose prefix prefill masks the prior
    scores, whose nucleus keeps the crossing token and whose Gemma3 has none of its four
    defects: no release has any of these."""
    adapter = modules.hf_adapter.HuggingFaceGenerationAdapter
    published_prepare = adapter.prepare_inputs_for_generation

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        config = self.neuron_config
        if config.is_prefix_caching and mask is not None:
            grown = input_ids.shape[1] - mask.shape[1]
            kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], grown))],
                                                 -1) if grown > 0 else mask
        inputs = published_prepare(self, input_ids, *args, **kwargs)
        if config.is_prefix_caching:
            inputs.update(prefix_lens.prefix_cache_inputs(
                inputs["attention_mask"], False, block_size=config.pa_block_size,
                seq_len=config.seq_len, num_blocks=config.pa_num_blocks))
        return inputs

    wrapper = modules.model_wrapper.ModelWrapper
    published_bucket = wrapper._get_seq_bucket

    def _get_seq_bucket(self, buckets, input_len, speculation_length, strategy):
        if self.tag == modules.model_wrapper.CONTEXT_ENCODING_MODEL_TAG and input_len in buckets:
            return input_len
        return published_bucket(self, buckets, input_len, speculation_length, strategy)

    def perform_prefix_prefill(self, Q, K, V, q_len, bsz, attention_mask, past_key_value,
                               active_mask):
        masked = prefix_prefill_mask.masked_prefix_prefill(
            self, modules.attention_base, Q, K, V, attention_mask, past_key_value, active_mask)
        return masked, modules.attention_base.FlashAttentionStrategy.NONE

    def _multinomial_sample(self, token_logits, sampling_params, return_values, dim, rank_id):
        return sampler_top_p.vllm_nucleus_sample(self, modules.sampling, token_logits,
                                                 sampling_params, return_values, dim, rank_id)

    monkeypatch.setattr(adapter, "prepare_inputs_for_generation", prepare_inputs_for_generation)
    monkeypatch.setattr(wrapper, "_get_seq_bucket", _get_seq_bucket)
    monkeypatch.setattr(modules.attention_base.NeuronAttentionBase, "perform_prefix_prefill",
                        perform_prefix_prefill)
    monkeypatch.setattr(modules.sampling.Sampler, "_multinomial_sample", _multinomial_sample)
    if modules.gemma3 is not None:
        gemma3_fixed(modules.gemma3, monkeypatch)


# A sequence of 128 tokens: NxDI's prefix-caching cache tiles each block by 128 / blocks
# per sequence (block_kv_cache_manager.py _init_kv_shape_for_prefix_caching), which leaves
# a block of pa_block_size // tiling_factor = 0 rows below max_length 128.
PREFIX_CACHING = dict(is_block_kv_layout=True, is_prefix_caching=True, pa_block_size=8,
                      pa_num_blocks=16, seq_len=128, max_context_length=128,
                      context_encoding_buckets=[8, 128], token_generation_buckets=[16, 128],
                      prefix_buckets=[16, 128], batch_size=1, is_continuous_batching=False)


# -- probes ---------------------------------------------------------------------------
@pytest.mark.parametrize("nxdi", list(DEFECTS), indirect=True)
def test_probes_tell_defective_from_fixed_releases(nxdi, request):
    release = request.node.callspec.params["nxdi"]
    found = {p.name for p in PATCHES if p.probe(nxdi) is not None}
    assert found == DEFECTS[release]


@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
def test_probe_finds_the_undefined_global_of_the_published_source(nxdi):
    assert "undefined global" in adapter_inputs.probe(nxdi)
    assert "NameError" in prefix_lens.probe(nxdi)
    assert "bucket 4 of [2, 4]" in bucket_fit.probe(nxdi)


@pytest.mark.parametrize("nxdi", ["0.9"], indirect=True)
def test_probe_evidence_for_an_adapter_that_defines_the_hook(nxdi, monkeypatch):
    # The SDK 2.27 wheel measured in the field (NEURON_FINDINGS.md) passes the hook
    # without a NameError and fails in forward() with a TypeError.
    monkeypatch.setattr(nxdi.hf_adapter, "tensor_capture_hook", None, raising=False)
    assert "no such parameter" in adapter_inputs.probe(nxdi)
    assert "full_context_lens" in prefix_lens.probe(nxdi)


@pytest.mark.parametrize("nxdi", ["0.9-ef2731e"], indirect=True)
def test_probes_recognise_fixed_code(nxdi, monkeypatch):
    hypothetically_fixed(nxdi, monkeypatch)
    assert [p.probe(nxdi) for p in PATCHES] == [None] * len(PATCHES)


# -- registry -----------------------------------------------------------------------------
@pytest.mark.parametrize("nxdi", list(DEFECTS), indirect=True)
def test_apply_patches_applies_exactly_the_needed_ones_once(nxdi, request, caplog):
    release = request.node.callspec.params["nxdi"]
    with caplog.at_level(logging.INFO, logger="vllm.neuron_plugin.patches"):
        first = {o.name: o.status for o in apply_patches(nxdi, environ={})}
    assert first == {n: "applied" if n in DEFECTS[release] else "not needed" for n in NAMES}
    assert len([r for r in caplog.records if "NxDI patch" in r.getMessage()]) == len(NAMES)
    second = {o.name: o.status for o in apply_patches(nxdi, environ={})}
    assert second == {n: "already applied" if n in DEFECTS[release] else "not needed"
                      for n in NAMES}


@pytest.mark.parametrize("nxdi", ["0.7"], indirect=True)
def test_disable_switch(nxdi):
    adapter = nxdi.hf_adapter.HuggingFaceGenerationAdapter
    before = adapter.prepare_inputs_for_generation
    outcomes = apply_patches(nxdi, environ={DISABLE_ENV: "adapter-forward-kwargs, "
                                                         "adapter-prefix-lens"})
    assert [o.status for o in outcomes] == ["disabled", "disabled", "applied", "applied",
                                            "applied", "applied"] + ["not needed"] * (len(PATCHES) - 6)
    assert adapter.prepare_inputs_for_generation is before
    assert disabled_patches({DISABLE_ENV: "all"}) == frozenset(NAMES)
    with pytest.raises(ValueError, match="unknown patch.*cte-exact-bucket"):
        disabled_patches({DISABLE_ENV: "cte-exact-buckets"})


def test_replace_method_marks_and_unwraps():
    class Target:
        def method(self):
            return "original"

    original = Target.method
    assert replace_method(Target, "method", "one", lambda f: lambda self: f(self) + "+1")
    assert not replace_method(Target, "method", "one", lambda f: lambda self: "again")
    assert replace_method(Target, "method", "two", lambda f: lambda self: f(self) + "+2")
    assert Target().method() == "original+1+2"
    assert unpatched(Target.method) is original


def test_code_mentions_finds_names_constants_and_dict_keys():
    def uses_global():
        return tensor_capture_hook  # noqa: F821

    def uses_key(x):
        return {"position_ids": x, "tensor_capture_hook": None}

    assert code_mentions(uses_global.__code__, "tensor_capture_hook")
    assert code_mentions(uses_key.__code__, "tensor_capture_hook")
    assert not code_mentions(uses_key.__code__, "full_context_lens")


# -- (a) adapter-forward-kwargs -----------------------------------------------------------
def generate_twice(nxdi, model_dirs, tmp_path, error):
    model = build_model(nxdi, model_dirs["llama"], tmp_path)
    adapter = nxdi.hf_adapter.HuggingFaceGenerationAdapter(model)
    prompts = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    mask = torch.ones_like(prompts)
    with pytest.raises(error, match="tensor_capture_hook"):
        adapter.generate(prompts, attention_mask=mask, max_new_tokens=3)
    apply_patches(nxdi, environ={})
    out = adapter.generate(prompts, attention_mask=mask, max_new_tokens=3)
    assert out.tolist() == [greedy_continuation([3, 4, 5, 6], 3),
                            greedy_continuation([7, 8, 9, 10], 3)]


@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
def test_adapter_generate_fails_unpatched_and_works_patched(nxdi, model_dirs, tmp_path):
    generate_twice(nxdi, model_dirs, tmp_path, NameError)


@pytest.mark.parametrize("nxdi", ["0.9"], indirect=True)
def test_adapter_that_defines_the_hook_fails_in_forward_until_patched(nxdi, model_dirs,
                                                                    tmp_path, monkeypatch):
    monkeypatch.setattr(nxdi.hf_adapter, "tensor_capture_hook", None, raising=False)
    generate_twice(nxdi, model_dirs, tmp_path, TypeError)


@pytest.mark.parametrize("nxdi", ["0.9-ef2731e"], indirect=True)
def test_adapter_of_ef2731e_generates_unpatched(nxdi, model_dirs, tmp_path):
    model = build_model(nxdi, model_dirs["llama"], tmp_path)
    adapter = nxdi.hf_adapter.HuggingFaceGenerationAdapter(model)
    prompt = torch.tensor([[3, 4, 5, 6]] * 2)
    out = adapter.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2)
    assert out.tolist() == [greedy_continuation([3, 4, 5, 6], 2)] * 2


def test_accepted_inputs_filters_by_signature(caplog):
    def forward(input_ids=None, position_ids=None):
        return None

    def forward_kwargs(input_ids=None, **kwargs):
        return None

    inputs = {"input_ids": 1, "position_ids": 2, "tensor_capture_hook": None}
    assert adapter_inputs.accepted_inputs(forward, inputs) == {"input_ids": 1,
                                                               "position_ids": 2}
    assert adapter_inputs.accepted_inputs(forward_kwargs, inputs) == inputs
    with caplog.at_level(logging.WARNING, logger="vllm.neuron_plugin.patches"):
        adapter_inputs.accepted_inputs(forward, {**inputs, "tensor_capture_hook": print})
    assert "tensor_capture_hook" in caplog.text


# -- (b) adapter-prefix-lens --------------------------------------------------------------
@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
def test_prefix_caching_generate_fails_unpatched_and_works_patched(nxdi, model_dirs,
                                                                   tmp_path):
    model = build_model(nxdi, model_dirs["llama"], tmp_path, **PREFIX_CACHING)
    adapter = nxdi.hf_adapter.HuggingFaceGenerationAdapter(model)
    prompt = torch.tensor([[11, 12, 13, 14, 15]])
    mask = torch.ones_like(prompt)
    apply_patches(nxdi, environ={DISABLE_ENV: "adapter-prefix-lens"})
    with pytest.raises(TypeError, match="NoneType"):
        adapter.generate(prompt, attention_mask=mask, max_new_tokens=4)
    apply_patches(nxdi, environ={})
    out = adapter.generate(prompt, attention_mask=mask, max_new_tokens=4)
    assert out.tolist() == [greedy_continuation([11, 12, 13, 14, 15], 4)]


@pytest.mark.parametrize("nxdi", ["0.9-ef2731e"], indirect=True)
def test_fixed_code_generates_the_same_without_patches(nxdi, model_dirs, tmp_path,
                                                       monkeypatch):
    hypothetically_fixed(nxdi, monkeypatch)
    model = build_model(nxdi, model_dirs["llama"], tmp_path, **PREFIX_CACHING)
    adapter = nxdi.hf_adapter.HuggingFaceGenerationAdapter(model)
    prompt = torch.tensor([[11, 12, 13, 14, 15]])
    assert all(o.status == "not needed" for o in apply_patches(nxdi, environ={}))
    out = adapter.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4)
    assert out.tolist() == [greedy_continuation([11, 12, 13, 14, 15], 4)]


def test_prefix_cache_inputs_prefill_hand_worked():
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    got = prefix_lens.prefix_cache_inputs(mask, False, block_size=4, seq_len=8, num_blocks=4)
    assert got["full_context_lens"].tolist() == [[5], [3]]
    assert got["computed_context_lens"].tolist() == [[0], [0]]
    # row 0 owns blocks 0-1, row 1 blocks 2-3; two blocks hold 5 tokens
    assert got["block_table"].tolist() == [[0, 1], [2, 3]]
    assert got["slot_mapping"].tolist() == [[0, 1, 2, 3, 4], [8, 9, 10, -1, -1]]


def test_prefix_cache_inputs_decode_hand_worked():
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    got = prefix_lens.prefix_cache_inputs(mask, True, block_size=4, seq_len=8, num_blocks=4)
    assert got["full_context_lens"].tolist() == [[6], [4]]
    assert got["computed_context_lens"].tolist() == [[5], [3]]
    assert got["slot_mapping"].tolist() == [[5], [11]]


def test_prefix_cache_inputs_rejects_too_few_blocks():
    with pytest.raises(ValueError, match=r"pa_num_blocks=3 .*\(2 x 2 = 4 blocks\)"):
        prefix_lens.prefix_cache_inputs(torch.ones((2, 3)), False, block_size=4, seq_len=8,
                                        num_blocks=3)


# -- (c) cte-exact-bucket -----------------------------------------------------------------
@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
def test_context_equal_to_bucket_uses_that_bucket_after_patch(nxdi, model_dirs, tmp_path):
    model = build_model(nxdi, model_dirs["llama"], tmp_path)
    prompt = torch.arange(1, 9)[None, :]  # 8 tokens, the smallest bucket
    model(prompt, position_ids=torch.arange(8)[None, :], seq_ids=torch.tensor([0]))
    assert model.context_encoding_model.selected_buckets == [64]
    assert bucket_fit.PATCH.apply(nxdi)
    model(prompt, position_ids=torch.arange(8)[None, :], seq_ids=torch.tensor([1]))
    assert model.context_encoding_model.selected_buckets == [64, 8]
    # token generation keeps the strict rule: position 15 has 15 cached tokens and
    # writes the 16th slot of bucket 16; position 16 needs the next bucket.
    model(torch.tensor([[1]]), position_ids=torch.tensor([[15]]), seq_ids=torch.tensor([0]))
    model(torch.tensor([[1]]), position_ids=torch.tensor([[16]]), seq_ids=torch.tensor([0]))
    assert model.token_generation_model.selected_buckets == [16, 64]


@pytest.mark.parametrize("buckets,length,expected", [
    ([128, 256], 128, 128), ([128, 256], 129, None), ([[128, 0], [128, 512]], 128, None)])
def test_exact_bucket(buckets, length, expected):
    assert bucket_fit.exact_bucket(buckets, length) == expected


# -- (d) prefix-prefill-mask --------------------------------------------------------------
@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
def test_prefix_prefill_attends_the_cached_prefix_once_after_patch(nxdi):
    """One query over a cached prefix of 3 positions (the mask excludes the third, a
    position NxDI moved into the active part) and one active key: NxDI's non-kernel
    branch weighs all four keys, the patch the three the query may see."""
    attention = nxdi.attention_base.NeuronAttentionBase()
    q = torch.zeros(1, 1, 1, 2)
    v_prior = torch.tensor([[[[1.0, 0.0], [2.0, 0.0], [40.0, 0.0]]]])
    args = (q, torch.zeros(1, 1, 1, 2), torch.tensor([[[[3.0, 0.0]]]]), 1, 1,
            torch.tensor([[1, 1, 0]]), (torch.zeros(1, 1, 3, 2), v_prior),
            torch.ones(1, 1, 1, 1, dtype=torch.bool))
    unpatched_out, _ = attention.perform_prefix_prefill(*args)
    assert unpatched_out[0, 0, 0, 0].item() == pytest.approx((1 + 2 + 40 + 3) / 4)
    assert prefix_prefill_mask.PATCH.apply(nxdi)
    patched_out, strategy = attention.perform_prefix_prefill(*args)
    assert patched_out[0, 0, 0, 0].item() == pytest.approx((1 + 2 + 3) / 3)
    assert strategy == nxdi.attention_base.FlashAttentionStrategy.NONE


@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
def test_prefix_prefill_patch_scales_scores_as_the_release_does(nxdi):
    """With every cached position visible NxDI's branch is right, so the patch must
    compute exactly what it computes: scores over sqrt(head_dim) in every release (0.7 and
    0.8 have no `softmax_scale`; 0.9 keeps it on the attention), grouped KV heads."""
    torch.manual_seed(0)
    attention = nxdi.attention_base.NeuronAttentionBase(num_key_value_groups=2, head_dim=8)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    prior = (torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    args = (q, k, v, 3, 2, torch.ones(2, 5, dtype=torch.int64), prior,
            torch.ones(3, 3, dtype=torch.bool).tril()[None, None])
    published, _ = attention.perform_prefix_prefill(*args)
    assert prefix_prefill_mask.PATCH.apply(nxdi)
    patched, _ = attention.perform_prefix_prefill(*args)
    assert torch.allclose(patched, published, atol=1e-6)


@pytest.mark.parametrize("nxdi", ["0.9"], indirect=True)
def test_prefix_prefill_kernel_branch_is_left_to_nxdi(nxdi, monkeypatch):
    calls = []
    monkeypatch.setattr(nxdi.attention_base.NeuronAttentionBase, "perform_prefix_prefill",
                        lambda self, *args: calls.append(args) or ("kernel", "strategy"))
    prefix_prefill_mask.PATCH.apply(nxdi)
    attention = nxdi.attention_base.NeuronAttentionBase()
    monkeypatch.setattr(attention, "get_flash_attention_strategy",
                        lambda *a, **k: nxdi.attention_base.FlashAttentionStrategy.SHARDED_KERNEL)
    assert attention.perform_prefix_prefill(*range(8)) == ("kernel", "strategy")
    assert calls == [tuple(range(8))]


# -- (e) sampler-top-p --------------------------------------------------------------------
def _nucleus(nxdi, logits, top_p):
    """The probabilities NxDI's sampler draws from for one row (global top-k = vocab)."""
    sampler = sampler_top_p._stand_in(nxdi.sampling.Sampler)
    object.__setattr__(sampler, "global_topk", logits.shape[-1])
    params = torch.tensor([[float(logits.shape[-1]), top_p, 1.0]])
    indices, probs = sampler._multinomial_sample(logits[None, :], params, True, 1, None)
    nucleus = torch.zeros_like(logits)
    nucleus[indices[0]] = probs[0]
    return nucleus


@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
@pytest.mark.parametrize("top_p", [0.5, 0.7, 0.8, 0.9, 0.95])
def test_device_nucleus_equals_vllms_after_patch(nxdi, top_p):
    """vLLM's own top-k/top-p (vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p) is
    the oracle: unpatched, NxDI's nucleus lacks the crossing token; patched, it is vLLM's."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = torch.log(torch.tensor([0.35, 0.25, 0.2, 0.12, 0.05, 0.03]))
    expected = torch.softmax(apply_top_k_top_p(logits[None, :].clone(), None,
                                               torch.tensor([top_p])), -1)[0]
    before = _nucleus(nxdi, logits, top_p)
    assert int((before > 0).sum()) == int((expected > 0).sum()) - 1
    assert sampler_top_p.PATCH.apply(nxdi)
    assert torch.allclose(_nucleus(nxdi, logits, top_p), expected, atol=1e-6)


# -- (f) cpu-captured-offset -------------------------------------------------------------
def _cpu_application(nxdi, output_logits: bool):
    """NxDI's causal LM as its CPU mode leaves it, as far as its KV copy reads it: a
    config and both wrappers' eager models with their KV cache managers."""
    from neuronx_distributed_inference.models.application_base import KVCacheManager

    application = object.__new__(nxdi.model_base.NeuronBaseForCausalLM)
    application.neuron_config = type("NeuronConfig", (), dict(
        output_logits=output_logits, on_device_sampling_config=object() if output_logits
        else None, tensor_capture_config=None))()
    for tag in ("context_encoding_model", "token_generation_model"):
        wrapper = type("Wrapper", (), {})()
        wrapper.model = type("Eager", (), {"kv_mgr": KVCacheManager(num_layers=1)})()
        object.__setattr__(application, tag, wrapper)
    return application


@pytest.mark.parametrize("nxdi", PUBLISHED, indirect=True)
@pytest.mark.parametrize("output_logits", [False, True])
def test_cpu_mode_kv_copy_runs_in_every_release_after_patch(nxdi, request, output_logits):
    """A CPU forward's outputs are tokens (and logits), then K and V of each layer: the
    copy must put exactly the cache into both submodels' KV managers."""
    application = _cpu_application(nxdi, output_logits)
    head = [torch.zeros(1)] * (2 if output_logits else 1)
    cache = [torch.full((1, 2), 3.0), torch.full((1, 2), 4.0)]
    if request.node.callspec.params["nxdi"] != "0.9":
        with pytest.raises(AttributeError, match="_get_captured_tensors_offset"):
            application._copy_past_key_values(head + cache)
        assert cpu_captured_offset.PATCH.apply(nxdi)
    application._copy_past_key_values(head + cache)
    for tag in ("context_encoding_model", "token_generation_model"):
        kept = getattr(application, tag).model.kv_mgr.past_key_values
        assert [t.tolist() for t in kept] == [[[3.0, 3.0]], [[4.0, 4.0]]]


def test_cpu_mode_patch_changes_no_compiled_graph():
    assert not cpu_captured_offset.PATCH.changes("LlamaForCausalLM")
    assert prefix_prefill_mask.PATCH.changes("LlamaForCausalLM")
