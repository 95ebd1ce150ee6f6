"""The gemma3 patches against the NxDI double's Gemma3 (its 0.9 modeling_gemma3.py, and
0.8's, which 0.8 ships without listing it; NxDI's defects reproduced): each probe finds
its release's defects, each fix makes NxDI's code compute what transformers' Gemma3
computes (the checkpoint's config and layer kinds, each layer's own RoPE, the local
window in every attention phase, float32 norms on 0.9, the query_pre_attn_scalar score
scale and buildable CPU-mode norms on 0.8). That the patched model gives transformers'
tokens is shown on real NxDI 0.8 and 0.9 (tests/e2e/test_nxdi_architectures.py)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from tests.plugin.fake_nxdi.nxdi_release import load_release, purge
from neuron_plugin.patches import apply_patches, gemma3
from neuron_plugin.patches.base import unpatched

GEMMA3 = {p.name for p in gemma3.PATCHES}
# what each release's module needs (NxDI's CPU mode adds gemma3-cpu-norm on 0.8)
GEMMA3_0_9 = {"gemma3-config", "gemma3-rope", "gemma3-window", "gemma3-norms"}
GEMMA3_0_8 = {"gemma3-config", "gemma3-rope", "gemma3-window", "gemma3-scale"}


@pytest.fixture
def nxdi(monkeypatch):
    monkeypatch.delenv("NXD_CPU_MODE", raising=False)
    yield load_release("0.9-ef2731e", monkeypatch)
    purge()


@pytest.fixture
def nxdi08(monkeypatch):
    """NxDI 0.8's Gemma3 (shipped, not in MODEL_TYPES), outside NxD's CPU mode."""
    monkeypatch.delenv("NXD_CPU_MODE", raising=False)
    yield load_release("0.8", monkeypatch)
    purge()


def tiny_config(nxdi, model_dir, **neuron):
    """NxDI's Gemma3InferenceConfig of a checkpoint, loaded as the backend loads it."""
    module = nxdi.gemma3
    neuron_config = module.Gemma3NeuronConfig(tp_degree=1, batch_size=1, seq_len=64,
                                               torch_dtype="float32", **neuron)
    return module.Gemma3InferenceConfig(
        neuron_config, load_config=nxdi.hf_adapter.load_pretrained_config(str(model_dir)))


def recorded_layer(nxdi, config, index):
    """NxDI's decoder layer `index` of `config` with a recording attention and an identity
    MLP (their math is the device's)."""
    layer = nxdi.gemma3.NeuronGemma3DecoderLayer(nxdi.gemma3.get_updated_configs(config)[index],
                                                 index)
    calls = []

    def attention(hidden_states, **kwargs):
        calls.append(kwargs)
        return hidden_states, None, "cos", "sin"

    layer.self_attn.forward = attention
    layer.mlp.forward = lambda x: (x,)
    return layer, calls


def hypothetically_fixed(module, monkeypatch) -> None:
    """A Gemma3 module with none of the four defects: no release has it."""
    published_init = module.Gemma3InferenceConfig.__init__

    def config_init(self, neuron_config, fused_spec_config=None, load_config=None):
        kept = {}
        published_init(self, neuron_config, fused_spec_config,
                       lambda c: (load_config(c), kept.update(vars(c))))
        self.__dict__.update(gemma3.checkpoint_values(kept))

    published_forward = module.NeuronGemma3DecoderLayer.forward

    def forward(self, *args, **kwargs):
        return (*published_forward(self, *args, **kwargs)[:2], None, None, None)

    def setup_attr_for_model(self, config):
        self.sliding_window = config.sliding_window

    def norm_init(self, hidden_size, eps=1e-6):
        torch.nn.Module.__init__(self)
        self.eps, self.weight = eps, torch.nn.Parameter(torch.zeros(hidden_size))

    monkeypatch.setattr(module.Gemma3InferenceConfig, "__init__", config_init)
    monkeypatch.setattr(module, "get_updated_configs", gemma3.layer_configs)
    monkeypatch.setattr(module.NeuronGemma3DecoderLayer, "forward", forward)
    monkeypatch.setattr(module.NeuronGemma3TextModel, "setup_attr_for_model",
                        setup_attr_for_model)
    monkeypatch.setattr(module.NeuronGemma3RMSNorm, "__init__", norm_init)


# -- probes -------------------------------------------------------------------------------
def test_probes_find_the_four_defects(nxdi, monkeypatch):
    assert "replaces the checkpoint's vocab_size 5 and rope_theta 7.0 by 262208 and " \
           "1000000.0" in gemma3.probe_config(nxdi)
    assert "windows [4, 4]" in gemma3.probe_config(nxdi)
    assert "hands its RoPE tables to the next layer" in gemma3.probe_rope(nxdi)
    assert "leaves the model's sliding_window unset" in gemma3.probe_window(nxdi)
    assert "torch.bfloat16" in gemma3.probe_norms(nxdi)
    # 0.9 scales scores by query_pre_attn_scalar and builds its own norms on the CPU
    monkeypatch.setenv("NXD_CPU_MODE", "1")
    assert gemma3.probe_scale(nxdi) is None and gemma3.probe_cpu_norm(nxdi) is None


def test_probes_find_0_8s_defects(nxdi08, monkeypatch):
    """0.8's module shares the config, RoPE and window defects, declares float32 norms
    (not needed), passes no score scale, and in NxD's CPU mode builds transformers'
    norm with a keyword it does not take."""
    found = {p.name for p in gemma3.PATCHES if p.probe(nxdi08) is not None}
    assert found == GEMMA3_0_8
    assert "windows [4, 4]" in gemma3.probe_config(nxdi08)
    assert "no softmax_scale: scores are divided by sqrt(head_dim=2), not by " \
           "sqrt(query_pre_attn_scalar=8)" in gemma3.probe_scale(nxdi08)
    monkeypatch.setenv("NXD_CPU_MODE", "1")
    assert "Gemma3RMSNorm, which takes no hidden_size" in gemma3.probe_cpu_norm(nxdi08)
    outcomes = {o.name: o.status for o in apply_patches(nxdi08, environ={})}
    assert {n for n, status in outcomes.items() if n in GEMMA3 and status == "applied"} == \
        GEMMA3_0_8 | {"gemma3-cpu-norm"}


def test_probes_recognise_fixed_code(nxdi, monkeypatch):
    hypothetically_fixed(nxdi.gemma3, monkeypatch)
    assert [p.probe(nxdi) for p in gemma3.PATCHES] == [None] * len(gemma3.PATCHES)


def test_a_release_without_gemma3_needs_none(monkeypatch):
    modules = load_release("0.7", monkeypatch)
    try:
        assert modules.gemma3 is None
        outcomes = {o.name: o.status for o in apply_patches(modules, environ={})}
        assert {outcomes[name] for name in GEMMA3} == {"not needed"}
    finally:
        purge()


# -- gemma3-config ------------------------------------------------------------------------
def test_config_keeps_the_checkpoints_values_and_layer_kinds(nxdi, tiny_model):
    model_dir = tiny_model("gemma3")  # vocabulary 977, layers sliding/full/sliding
    before = tiny_config(nxdi, model_dir)
    assert (before.vocab_size, before.rope_scaling) == (262208, 8.0)
    assert [c.sliding_window for c in nxdi.gemma3.get_updated_configs(before)] == [16] * 3
    assert gemma3.PATCHES[0].apply(nxdi)
    config = tiny_config(nxdi, model_dir)
    assert (config.vocab_size, config.rope_scaling, config.max_position_embeddings) == (
        977, None, 4096)
    assert (config.global_rope_theta, config.local_rope_theta) == (1000000.0, 10000.0)
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert [c.sliding_window for c in nxdi.gemma3.get_updated_configs(config)] == [16, None, 16]
    assert not gemma3.PATCHES[0].apply(nxdi)  # idempotent


def test_config_of_nxdis_own_shape_keeps_the_linear_factor(nxdi, tiny_model):
    gemma3.PATCHES[0].apply(nxdi)
    config = tiny_config(nxdi, tiny_model("gemma3_nxdi"))
    assert (config.vocab_size, config.rope_scaling) == (262208, 8.0)
    assert [c.sliding_window for c in nxdi.gemma3.get_updated_configs(config)] == [16] * 5 + [
        None]


@pytest.mark.parametrize("text, expected", [
    # transformers 4.x keys
    ({"rope_theta": 5.0, "rope_local_base_freq": 3.0, "rope_scaling": None},
     {"global_rope_theta": 5.0, "local_rope_theta": 3.0, "rope_scaling": None}),
    ({"rope_theta": 5.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
     {"global_rope_theta": 5.0, "rope_scaling": 4.0}),
    # transformers 5.x: per layer type
    ({"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 9.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1.0}}},
     {"global_rope_theta": 9.0, "local_rope_theta": 1.0, "rope_scaling": 2.0}),
], ids=["4.x", "4.x-linear", "5.x"])
def test_checkpoint_values_read_both_transformers_majors(text, expected):
    assert gemma3.checkpoint_values(text) == expected
    nested = gemma3.checkpoint_values({"text_config": SimpleNamespace(**text)})
    assert nested == expected


def test_layer_kinds_without_layer_types_follow_transformers_pattern():
    config = SimpleNamespace(num_hidden_layers=7, sliding_window_pattern=3)
    assert gemma3.layer_kinds(config) == ["sliding_attention", "sliding_attention",
                                          "full_attention"] * 2 + ["sliding_attention"]


# -- gemma3-rope --------------------------------------------------------------------------
def test_each_layer_computes_its_own_rope(nxdi, tiny_model):
    gemma3.PATCHES[0].apply(nxdi)
    config = tiny_config(nxdi, tiny_model("gemma3"))
    layer, calls = recorded_layer(nxdi, config, 1)
    hidden = torch.zeros(1, 2, config.hidden_size)
    before = layer(hidden, cos_cache="layer 0's", sin_cache="layer 0's")
    assert calls[-1]["cos_cache"] == "layer 0's" and before[2] == "cos"
    assert gemma3.PATCHES[1].apply(nxdi)
    after = layer(hidden, cos_cache="layer 0's", sin_cache="layer 0's")
    assert calls[-1]["cos_cache"] is None and calls[-1]["sin_cache"] is None
    assert after[2:4] == (None, None)


# -- gemma3-window ------------------------------------------------------------------------
def test_window_masks_hand_worked():
    # prefill of 5 tokens, window 2: each query sees itself and the one before
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    prior, active = gemma3.window_masks(causal, None, torch.arange(5)[None], 2)
    assert prior[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                                          [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert active is None
    # decode at position 5 over a cache of 8 (5 written), window 3: keys 3 and 4 (and
    # the active token)
    cached = (torch.arange(8) < 5)[None, None, None]
    prior, active = gemma3.window_masks(cached, torch.ones(1, 1, 1, 1, dtype=torch.bool),
                                        torch.tensor([[5]]), 3)
    assert prior[0, 0, 0].int().tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert active.tolist() == [[[[True]]]]
    # a prefill of positions 4, 5 over a cached prefix of 4 (NxDI's [batch, prefix] mask
    # of ints), window 3: position 4 sees cached 2, 3; position 5 sees cached 3
    prefix = torch.tensor([[1, 1, 1, 1]])
    tril = torch.ones(2, 2, dtype=torch.bool).tril()[None, None]
    prior, active = gemma3.window_masks(prefix, tril, torch.tensor([[4, 5]]), 3)
    assert prior[0, 0].int().tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert active[0, 0].int().tolist() == [[1, 0], [1, 1]]


def test_local_layers_attend_their_window_over_the_full_cache(nxdi, tiny_model):
    gemma3.PATCHES[0].apply(nxdi)
    config = tiny_config(nxdi, tiny_model("gemma3"), attn_kernel_enabled=True)
    local, calls = recorded_layer(nxdi, config, 0)
    assert local.self_attn.sliding_window == 16  # NxDI's windowed attention
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    hidden = torch.zeros(1, 20, config.hidden_size)
    local(hidden, attention_mask=causal, position_ids=torch.arange(20)[None])
    assert calls[-1]["attention_mask"] is causal  # every position before: the defect
    assert gemma3.PATCHES[2].apply(nxdi)
    local, calls = recorded_layer(nxdi, config, 0)
    glob, global_calls = recorded_layer(nxdi, config, 1)
    assert local.self_attn.sliding_window is None  # standard attention over the full cache
    assert local.self_attn.attn_kernel_enabled is False  # the kernel would not read the mask
    assert glob.self_attn.attn_kernel_enabled is True
    local(hidden, attention_mask=causal, position_ids=torch.arange(20)[None])
    assert calls[-1]["attention_mask"][0, 0, 19].int().tolist() == [0] * 4 + [1] * 16
    glob(hidden, attention_mask=causal, position_ids=torch.arange(20)[None])
    assert global_calls[-1]["attention_mask"] is causal


# -- gemma3-norms -------------------------------------------------------------------------
def test_norm_weights_are_float32_and_one_is_added_in_float32(nxdi):
    module = nxdi.gemma3
    assert module.NeuronGemma3RMSNorm(4).weight.dtype == torch.bfloat16
    w = torch.tensor([0.0123, -0.5, 0.3333, 2.0]).bfloat16()  # a bf16 checkpoint's weight
    config = SimpleNamespace(num_hidden_layers=1)

    def state_dict():
        names = ["norm", "layers.0.self_attn.q_norm", "layers.0.self_attn.k_norm",
                 "layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                 "layers.0.pre_feedforward_layernorm", "layers.0.post_feedforward_layernorm"]
        return {f"model.{n}.weight": w.clone() for n in names}

    rounded = module.NeuronGemma3ForCausalLM.convert_hf_to_neuron_state_dict(state_dict(),
                                                                             config)
    assert rounded["norm.weight"].dtype == torch.bfloat16
    assert not torch.equal(rounded["norm.weight"].float(), 1.0 + w.float())
    assert gemma3.PATCHES[3].apply(nxdi)
    assert module.NeuronGemma3RMSNorm(4).weight.dtype == torch.float32
    exact = module.NeuronGemma3ForCausalLM.convert_hf_to_neuron_state_dict(state_dict(), config)
    for name in ("norm.weight", "layers.0.self_attn.q_layernorm.weight",
                 "layers.0.post_feedforward_layernorm.weight"):
        assert torch.equal(exact[name], 1.0 + w.float())  # transformers' 1.0 + weight.float()


# -- gemma3-scale (0.8) -------------------------------------------------------------------
def test_0_8_queries_are_scaled_to_query_pre_attn_scalar(nxdi08, tiny_model):
    """0.8's attention divides scores by sqrt(head_dim) (32); transformers by
    sqrt(query_pre_attn_scalar) (24, the tiny checkpoint's): the patched query carries
    the difference, so any attention path of the release computes transformers' scores."""
    gemma3.PATCHES[0].apply(nxdi08)
    config = tiny_config(nxdi08, tiny_model("gemma3"))
    layer_config = nxdi08.gemma3.get_updated_configs(config)[0]
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    published = nxdi08.gemma3.NeuronGemma3Attention(layer_config)
    assert not hasattr(published, "softmax_scale")  # 0.8: scores / math.sqrt(head_dim)
    assert gemma3.apply_scale(nxdi08)
    patched = nxdi08.gemma3.NeuronGemma3Attention(layer_config)
    patched.q_layernorm.load_state_dict(published.q_layernorm.state_dict())
    ours = patched.q_layernorm(q) @ k.transpose(2, 3) / math.sqrt(patched.head_dim)
    theirs = published.q_layernorm(q) @ k.transpose(2, 3) / math.sqrt(24)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert not torch.allclose(published.q_layernorm(q) @ k.transpose(2, 3) / math.sqrt(32),
                              theirs, atol=1e-2)
    assert set(patched.q_layernorm.state_dict()) == {"weight"}  # the checkpoint's names
    assert not gemma3.apply_scale(nxdi08)  # idempotent


# -- gemma3-cpu-norm (0.8, NxD's CPU mode) ------------------------------------------------
def test_0_8_cpu_mode_builds_nxdis_own_norm(nxdi08, tiny_model, monkeypatch):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    monkeypatch.setenv("NXD_CPU_MODE", "1")
    gemma3.PATCHES[0].apply(nxdi08)
    config = nxdi08.gemma3.get_updated_configs(tiny_config(nxdi08, tiny_model("gemma3")))[0]
    with pytest.raises(TypeError, match="hidden_size"):
        nxdi08.gemma3.NeuronGemma3Attention(config)
    assert gemma3.apply_cpu_norm(nxdi08)
    attention = nxdi08.gemma3.NeuronGemma3Attention(config)
    assert type(attention.q_layernorm) is nxdi08.gemma3.NeuronGemma3RMSNorm
    theirs = Gemma3RMSNorm(32, eps=config.rms_norm_eps)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(32))
    attention.q_layernorm.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 32)
    assert torch.equal(attention.q_layernorm(x), theirs(x))  # the same math


def test_patched_functions_unwrap_to_nxdis(nxdi):
    published = nxdi.gemma3.get_updated_configs
    for patch in gemma3.PATCHES:
        patch.apply(nxdi)
    assert unpatched(nxdi.gemma3.get_updated_configs) is published
    config = SimpleNamespace(num_hidden_layers=2, sliding_window=4,
                             layer_types=["full_attention", "sliding_attention"])
    assert [c.sliding_window for c in nxdi.gemma3.get_updated_configs(copy.copy(config))] == [
        None, 4]


@pytest.mark.parametrize("release, expected", [("0.9-ef2731e", GEMMA3_0_9),
                                               ("0.8", GEMMA3_0_8)])
def test_gemma3_patches_key_gemma3s_compiled_graphs_only(release, expected, tiny_model,
                                                         monkeypatch):
    """The patches change what NxDI traces for Gemma3, so they are in its compile-cache
    key (each release's own; gemma3-cpu-norm changes no graph); another architecture's
    graphs (and key) do not depend on them. 0.8 serves its unlisted module."""
    from neuron_plugin.backends.nxd.backend import NxDBackend
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    monkeypatch.setenv("NXD_CPU_MODE", "1")
    load_release(release, monkeypatch)
    limits = EngineLimits(max_model_len=256, max_num_seqs=2, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=256, dtype="float32", tp_degree=1)

    def key_patches(arch: str, name: str) -> set[str]:
        settings = resolve_settings(limits, {}, backend="nxd", architecture=name)
        backend = NxDBackend(settings, tiny_model(arch))
        fields = backend.cache_manifest_fields()
        if name == "Gemma3ForCausalLM":
            assert backend.model_cls.__module__.endswith("models.gemma3.modeling_gemma3")
        return set(fields["versions"]["nxdi_patches"].split(","))

    try:
        assert key_patches("gemma3", "Gemma3ForCausalLM") & GEMMA3 == expected
        llama = key_patches("llama", "LlamaForCausalLM")
        assert "prefix-prefill-mask" in llama and not GEMMA3 & llama
    finally:
        purge()
