"""The nxd backend's image-to-text driver without NxDI (backends/nxd/image_to_text.py,
vision_arguments.py, qwen2_vl_vision.py, families/qwen3_vl.py and qwen2_vl, patches
vision_scatter, i2t_capture_hook and qwen2_vl_mrope): what it refuses for a
vision-language model and how each message names the setting and the fix, the vision
encoder's NeuronConfig, the image inputs of each call in the shapes of the graph's
example, Qwen2-VL's vision graph inputs, and the patches on stand-ins of the NxDI code
they fix (each names its NxDI file and function). The driver on real NxDI 0.8 and 0.9 against
transformers: tests/e2e/test_nxdi_qwen_vl.py, its graphs on XLA: test_nxdi_xla.py, the
patches on the real code: test_nxdi_patches.py."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch

from neuron_plugin.backends.nxd import compat, image_to_text, qwen2_vl_vision, qwen3_vl_vision
from neuron_plugin.backends.nxd.models import describe_architecture
from neuron_plugin.backends.nxd.vision_arguments import VisionExample, vision_arguments
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.vision import ImageInputs, VisionLimits, padding_image
from neuron_plugin.patches import NxDIModules, i2t_capture_hook, qwen2_vl_mrope, vision_scatter

ARCH = "Qwen3VLForConditionalGeneration"
QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
LIMITS = EngineLimits(max_model_len=256, max_num_seqs=2, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32", tp_degree=1,
                      vision=VisionLimits(16, 256, 4))
OVERRIDE = {"context_encoding_buckets": [128, 256], "token_generation_buckets": [256],
            "max_batch_buckets": 1, "vision_buckets": [64, 256]}
HIDDEN, LEVELS = 8, 2


def settings(limits=LIMITS, architecture=ARCH, **override):
    return resolve_settings(limits, {**OVERRIDE, **override}, backend="nxd",
                            architecture=architecture)


def test_the_served_configuration_is_not_refused():
    image_to_text.refuse_unsupported(settings())


@pytest.mark.parametrize(("change", "named"), [
    (dict(limits=dataclasses.replace(LIMITS, enable_prefix_caching=True, block_size=32)),
     "--no-enable-prefix-caching"),
    (dict(max_batch_buckets=2), "max_batch_buckets: 1"),
])
def test_what_image_to_text_apps_cannot_run_is_refused_by_name(change, named):
    limits = change.pop("limits", LIMITS)
    chosen = settings(limits, **change)
    with pytest.raises(NeuronConfigError) as info:
        image_to_text.refuse_unsupported(chosen)
    assert named in str(info.value)
    assert ARCH in str(info.value)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("is_chunked_prefill", True, "--no-enable-chunked-prefill"),
    ("speculation_method", "ngram", "--speculative-config"),
    ("max_loras", 2, "--enable-lora"),
    ("prompt_logprobs", 2, "prompt_logprobs"),
    # refused for every model when settings are resolved; the driver checks it again
    ("ctx_batch_size", 2, "ctx_batch_size: 1"),
])
def test_refusals_of_engine_features(field, value, named):
    with pytest.raises(NeuronConfigError, match=named):
        image_to_text.refuse_unsupported(dataclasses.replace(settings(), **{field: value}))


def test_logits_twins_are_refused_for_a_vision_model():
    """Every decode graph of an image-to-text model returns its logits: no logits-free
    twin whose lengths the key would choose."""
    with pytest.raises(NeuronConfigError, match=r"token_generation_logits_buckets=\[256\] "
                       r"with a vision-language model.*remove token_generation_logits"):
        settings(token_generation_logits_buckets=[256])
    assert settings().token_generation_logits_shapes() == []


def test_every_refusal_is_named_at_once():
    chosen = dataclasses.replace(settings(), max_loras=1, prompt_logprobs=1)
    with pytest.raises(NeuronConfigError) as info:
        image_to_text.refuse_unsupported(chosen)
    assert "--enable-lora" in str(info.value) and "prompt_logprobs" in str(info.value)


def test_vision_config_has_one_graph_per_vision_bucket():
    chosen = settings()
    kwargs = image_to_text.vision_neuron_config_kwargs(
        chosen, {"tp_degree": 1, "torch_dtype": "float32", "on_cpu": True, "batch_size": 2}, {})
    assert kwargs == {"tp_degree": 1, "torch_dtype": "float32", "on_cpu": True,
                      "batch_size": 1, "seq_len": 256, "enable_bucketing": True,
                      "buckets": [64, 256], "fused_qkv": True}
    with pytest.raises(NeuronConfigError, match="vision_buckets"):
        image_to_text.vision_neuron_config_kwargs(
            dataclasses.replace(chosen, vision_buckets=()), {}, {})


def test_llama4_vision_buckets_count_tiles_for_nxdi():
    """Llama4VisionModelWrapper buckets by tiles (chunks) per call; the plugin's vision
    buckets count patches, (56 / 14)**2 = 16 a tile for the tiny checkpoint."""
    chosen = dataclasses.replace(
        settings(), architecture="Llama4ForConditionalGeneration", vision_buckets=(48, 80))
    config = {"vision_config": {"image_size": 56, "patch_size": 14}}
    kwargs = image_to_text.vision_neuron_config_kwargs(chosen, {}, config)
    assert kwargs["buckets"] == [3, 5] and kwargs["seq_len"] == 5


def test_vision_buckets_must_fit_the_longest_context_encoding():
    config = {"vision_config": {"spatial_merge_size": 2}, "text_config": {"hidden_size": 8}}
    image_to_text.check_vision_fits(settings(), config)  # 256 patches: 64 tokens
    too_large = dataclasses.replace(settings(), vision_buckets=(64, 2048))
    with pytest.raises(NeuronConfigError, match="at most 1024 patches"):
        image_to_text.check_vision_fits(too_large, config)


def test_a_vision_model_decodes_with_logits_in_every_graph():
    assert settings().token_generation_logits_shapes() == []


def test_an_architecture_without_an_encoder_is_refused():
    assert image_to_text.encoder_for(ARCH) is qwen3_vl_vision.encode
    assert image_to_text.encoder_for(QWEN2_VL) is qwen2_vl_vision.encode
    assert image_to_text.encoder_for(QWEN2_5_VL) is qwen2_vl_vision.encode
    with pytest.raises(NeuronConfigError, match="VLLM_NEURON_BACKEND=reference"):
        image_to_text.encoder_for("MllamaForConditionalGeneration")


@pytest.mark.parametrize("release", nxdi_releases.CHECKED, ids=lambda r: r.release)
def test_qwen3_vl_is_served_on_every_checked_release(release, tiny_model):
    assert describe_architecture(ARCH, [], release) == "NxDI MODEL_TYPES['qwen3_vl']['causal-lm']"
    table = compat.support(ARCH, release)
    assert table["contiguous"].startswith("equal") and table["block"].startswith("refused")
    config = json.loads((tiny_model("qwen3_vl") / "config.json").read_text())
    assert compat.problems(settings(), config, release.release, {}) == []
    disabled = compat.problems(settings(), config, release.release,
                               {vision_scatter.NAME: "disabled"})
    assert len(disabled) == 1 and "VLLM_NEURON_DISABLE_PATCHES" in disabled[0]


@pytest.mark.parametrize(("architecture", "tiny", "cls"), [
    (QWEN2_VL, "qwen2_vl", "NeuronQwen2VLForImageToText"),
    (QWEN2_5_VL, "qwen2_5_vl", "NeuronQwen25VLForImageToText"),
])
@pytest.mark.parametrize("release", nxdi_releases.CHECKED, ids=lambda r: r.release)
def test_the_qwen2_vl_family_is_served_by_the_plugins_classes(release, architecture, tiny,
                                                                cls, tiny_model):
    assert describe_architecture(architecture, [], release).endswith(
        f"families.qwen2_vl.modeling:{cls}")
    table = compat.support(architecture, release)
    assert table["contiguous"].startswith("equal") and table["block"].startswith("refused")
    chosen = settings(architecture=architecture)
    config = json.loads((tiny_model(tiny) / "config.json").read_text())
    assert compat.problems(chosen, config, release.release, {}) == []
    disabled = compat.problems(chosen, config, release.release,
                               {qwen2_vl_mrope.NAME: "disabled"})
    assert len(disabled) == 1 and "qwen2-vl-mrope" in disabled[0]
    assert "M-RoPE" in disabled[0] and "VLLM_NEURON_DISABLE_PATCHES" in disabled[0]


@pytest.mark.parametrize("architecture", [QWEN2_VL, QWEN2_5_VL])
def test_qwen2_vl_vision_encoder_settings_keep_the_masked_attention_off_the_kernel(
        architecture):
    kwargs = image_to_text.vision_neuron_config_kwargs(
        settings(architecture=architecture), {"tp_degree": 2, "torch_dtype": torch.float32},
        {})
    assert kwargs["buckets"] == [64, 256] and kwargs["seq_len"] == 256
    assert kwargs["fused_qkv"] is True and kwargs["attn_kernel_enabled"] is False


# -- Qwen2-VL's vision graph inputs -------------------------------------------------------
class VisionWrapper:
    """The plugin's Qwen2-VL vision wrapper as the encoder uses it
    (families/qwen2_vl/modeling.py AnyGridVisionWrapper: NxDI's ModelWrapper, whose
    `_forward` runs the module on the CPU; config.vision_config as NxDI's
    Qwen2VLInferenceConfig holds it): a module answering each merge group's first
    patch's first value, and what it was called with."""

    def __init__(self, **window_size: int) -> None:
        neuron_config = types.SimpleNamespace(torch_dtype=torch.float32)
        self.config = types.SimpleNamespace(vision_config=types.SimpleNamespace(
            in_channels=3, temporal_patch_size=2, patch_size=2, spatial_merge_size=2,
            neuron_config=neuron_config, **window_size))
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def _forward(self, pixels, rotary_ids, groups):
        self.calls.append((pixels, rotary_ids, groups))
        return pixels[::4, :1].repeat(1, 3)  # [P / 4, 3]


def test_qwen2_vl_graph_inputs_pad_an_image_to_its_bucket():
    wrapper = VisionWrapper()
    pixels = np.arange(8 * 24, dtype=np.float32).reshape(8, 24)
    image = ImageInputs(pixels, np.array([1, 2, 4]))  # 8 patches, 2 merge groups
    rows = qwen2_vl_vision.encode(wrapper, image, 16)
    got_pixels, rotary_ids, groups = wrapper.calls[0]
    assert got_pixels.shape == (16, 24) and rotary_ids.shape == (16, 2)
    assert groups.shape == (2, 16)
    assert rotary_ids.dtype == groups.dtype == torch.int32
    assert torch.equal(got_pixels[:8], torch.from_numpy(pixels)) and not got_pixels[8:].any()
    # merge-block order: (0,0) (0,1) (1,0) (1,1), then the next 2 x 2 block
    assert rotary_ids[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1],
                                       [0, 2], [0, 3], [1, 2], [1, 3]]
    assert groups[0].tolist() == [0] * 8 + [-1] * 8  # one frame, then padding
    assert torch.equal(groups[1], groups[0])  # Qwen2-VL: no windows
    assert rows.shape == (2, 3) and rows.dtype == np.float32
    assert rows[:, 0].tolist() == [pixels[0, 0], pixels[4, 0]]


def test_qwen2_5_vl_graph_inputs_give_each_patch_its_window():
    """window_size 4 pixels with 2-pixel patches and 2 x 2 merges: one merge group a side
    (transformers' vit_merger_window_size 4 // 2 // 2), so a 2 x 4 grid has two windows of
    four patches each."""
    wrapper = VisionWrapper(window_size=4)
    pixels = np.ones((8, 24), dtype=np.float32)
    qwen2_vl_vision.encode(wrapper, ImageInputs(pixels, np.array([1, 2, 4])), 8)
    _, _, groups = wrapper.calls[0]
    assert groups[0].tolist() == [0] * 8
    assert groups[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_padding_image_runs_its_bucket_and_answers_no_rows():
    wrapper = VisionWrapper()
    rows = qwen2_vl_vision.encode(wrapper, padding_image(16), 16)
    got_pixels, _, groups = wrapper.calls[0]
    assert got_pixels.shape == (16, 24) and not got_pixels.any()
    assert (groups == -1).all() and rows.shape == (0, 3)


# -- image inputs of a call ---------------------------------------------------------------
def context_example(width: int, embeddings: int) -> VisionExample:
    """A Qwen3-VL context-encoding example's image inputs (modeling_qwen3_vl_text.py
    NeuronQwen3VLTextModelWrapper.get_dummy_vision_inputs: embeddings [1, E, hidden],
    positions int32 [1, bucket, 1], DeepStack [levels, 1, E, hidden])."""
    return VisionExample(
        rotary=True,
        embeddings=torch.zeros(1, embeddings, HIDDEN),
        mask=torch.zeros(1, width, 1, dtype=torch.int32),
        deepstack=torch.zeros(LEVELS, 1, embeddings, HIDDEN),
    )


def test_context_image_inputs_are_positions_rows_and_deepstack_levels():
    chosen = settings()
    inputs = context_encoding_inputs(chosen, np.arange(1, 11), 0, 0, None)
    width = inputs.input_ids.shape[1]
    mask = np.zeros((1, width), dtype=bool)
    mask[0, [3, 4, 7]] = True
    rows = np.arange(3 * HIDDEN * (1 + LEVELS), dtype=np.float32).reshape(3, -1)
    embeddings = np.zeros((1, width, HIDDEN * (1 + LEVELS)), dtype=np.float32)
    embeddings[mask] = rows
    rope = np.stack([inputs.position_ids, inputs.position_ids + 1, inputs.position_ids + 2])
    inputs = dataclasses.replace(inputs, vision_embeddings=embeddings, vision_mask=mask,
                                 rope_positions=rope)
    args = vision_arguments(inputs, inputs.position_ids, context_example(width, 256), HIDDEN)
    assert args["vision_mask"].dtype == torch.int32
    assert args["vision_mask"][0, :, 0].tolist() == [3, 4, 7] + [width] * (width - 3)
    assert args["vision_embeddings"].shape == (1, 256, HIDDEN)
    assert torch.equal(args["vision_embeddings"][0, :3], torch.from_numpy(rows[:, :HIDDEN]))
    assert not args["vision_embeddings"][0, 3:].any()
    for level in range(LEVELS):
        part = rows[:, HIDDEN * (1 + level) : HIDDEN * (2 + level)]
        assert torch.equal(args["deepstack_vision_embeds"][level, 0, :3], torch.from_numpy(part))
    assert args["rotary_position_ids"].dtype == torch.int32
    assert args["rotary_position_ids"].tolist() == rope.tolist()


def test_a_text_only_call_passes_empty_image_inputs_of_the_graph_shapes():
    chosen = settings()
    inputs = context_encoding_inputs(chosen, np.arange(1, 11), 0, 0, None)
    width = inputs.input_ids.shape[1]
    args = vision_arguments(inputs, inputs.position_ids, context_example(width, width), HIDDEN)
    assert args["vision_mask"][0, :, 0].tolist() == [width] * width  # the scratch row only
    assert not args["vision_embeddings"].any() and not args["deepstack_vision_embeds"].any()
    assert args["rotary_position_ids"].tolist() == [inputs.position_ids.tolist()] * 3


def test_decode_image_inputs_are_the_example_and_shifted_positions():
    chosen = settings()
    inputs = token_generation_inputs(chosen, np.array([5, 6]), np.array([40, 12]),
                                     np.arange(2), None)
    shifted = np.stack([inputs.position_ids + np.array([[-7], [0]])] * 3)
    inputs = dataclasses.replace(inputs, rope_positions=shifted)
    empty = VisionExample(True, torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0))
    args = vision_arguments(inputs, inputs.position_ids, empty, HIDDEN)
    assert args["vision_embeddings"] is empty.embeddings and args["vision_mask"] is empty.mask
    assert args["rotary_position_ids"][:, :, 0].tolist() == [[33, 12]] * 3


# -- the patches on stand-ins -------------------------------------------------------------
def nxdi_scatter(target: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
    """NxDI's merge as models/llama4/utils/encoder_utils.py scatter_by_index_put does it
    (cd3abf3 and ef2731e lines 248-281): the batch flattened, the first len(positions)
    rows written at the positions with index_put_ (an out-of-range position raises)."""
    width = target.shape[-1]
    out = target.clone()
    flat_positions = positions.view(-1)
    out.view(-1, width).index_put_((flat_positions,),
                                   rows.view(-1, width)[: len(flat_positions)])
    return out


def modules(**fields) -> NxDIModules:
    return NxDIModules(*(types.ModuleType(n) for n in (
        "model_base", "model_wrapper", "hf_adapter", "attention_base", "sampling")), **fields)


def test_scatter_patch_keeps_a_full_buckets_last_token():
    text = types.ModuleType("modeling_qwen3_vl_text")
    text.scatter_by_index_put = nxdi_scatter
    found = modules(vision_text=(text,))
    target = torch.arange(6, dtype=torch.float32).view(1, 3, 2)
    rows = torch.full((3, 2), -1.0)
    positions = torch.tensor([[[1], [3], [3]]])  # one image token, two pads at L
    with pytest.raises(IndexError):
        text.scatter_by_index_put(target, rows, positions)
    assert "modeling_qwen3_vl_text" in vision_scatter.probe(found)
    assert vision_scatter.apply(found)
    assert not vision_scatter.apply(found)  # idempotent
    out = text.scatter_by_index_put(target, rows, positions)
    assert out.tolist() == [[[0.0, 1.0], [-1.0, -1.0], [4.0, 5.0]]]
    # NxDI's own L - 1 padding still writes there, as before
    legacy = text.scatter_by_index_put(target, rows, torch.tensor([[[1], [2], [2]]]))
    assert legacy.tolist() == nxdi_scatter(target, rows, torch.tensor([[[1], [2], [2]]])).tolist()
    assert vision_scatter.probe(modules()) is None  # a release without Qwen3-VL
    qwen2_vl_text = types.ModuleType("modeling_qwen2_vl_text")
    qwen2_vl_text.scatter_by_index_put = nxdi_scatter
    assert "modeling_qwen2_vl_text" in vision_scatter.probe(modules(vision_text=(qwen2_vl_text,)))


def image_to_text_base(source: str) -> types.ModuleType:
    """A stand-in of models/image_to_text_model_base.py holding `source`'s class."""
    module = types.ModuleType("image_to_text_model_base")
    exec(source, module.__dict__)
    return module


def test_capture_hook_patch_defines_the_global_only_where_it_is_read():
    # 0.8 (cd3abf3 image_to_text_model_base.py line 625): the forward reads a global
    base = image_to_text_base(
        "class NeuronBaseForImageToText:\n"
        "    def forward(self):\n"
        "        return tensor_capture_hook\n")
    found = modules(image_to_text_model_base=base)
    with pytest.raises(NameError):
        base.NeuronBaseForImageToText().forward()
    assert "NameError" in i2t_capture_hook.probe(found)
    assert i2t_capture_hook.apply(found) and not i2t_capture_hook.apply(found)
    assert base.NeuronBaseForImageToText().forward() is None
    assert i2t_capture_hook.probe(found) is not None  # still recognised as patched
    # 0.9 (ef2731e line 539): a parameter
    fixed = image_to_text_base(
        "class NeuronBaseForImageToText:\n"
        "    def forward(self, tensor_capture_hook=None):\n"
        "        return tensor_capture_hook\n")
    assert i2t_capture_hook.probe(modules(image_to_text_model_base=fixed)) is None
    assert i2t_capture_hook.probe(modules()) is None  # a release without the base


def test_pixtral_vision_inputs_are_its_wrappers_patchify_padded_to_the_bucket():
    """pixtral_vision.graph_inputs for a 2 x 3-patch image in an 8-patch bucket: the
    patches as given, a block mask over them (zero for padding: the wrapper's
    pad_inputs), positions row x (image_size / patch) + column
    (modeling_pixtral_vision.py position_ids_in_meshgrid, max_width image_size / patch),
    0 for padding; a padding image is all padding."""
    from neuron_plugin.backends.nxd import pixtral_vision
    from neuron_plugin.core.vision import ImageInputs, padding_image

    vision = types.SimpleNamespace(
        num_channels=3, patch_size=2, image_size=8,
        neuron_config=types.SimpleNamespace(torch_dtype=torch.float32))
    wrapper = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    pixels = np.arange(6 * 12, dtype=np.float32).reshape(6, 12)
    embeds, mask, positions = pixtral_vision.graph_inputs(
        wrapper, ImageInputs(pixels, np.array([1, 2, 3])), 8)
    assert embeds.shape == (1, 8, 12)
    assert embeds[0, :6].numpy().tolist() == pixels.tolist()
    assert not embeds[0, 6:].any()
    assert mask.dtype == torch.int32 and mask.shape == (1, 1, 8, 8)
    assert mask[0, 0, :6, :6].all() and mask.sum() == 36
    assert positions.tolist() == [0, 1, 2, 4, 5, 6, 0, 0]
    padded = pixtral_vision.graph_inputs(wrapper, padding_image(8), 8)
    assert not any(t.any() for t in padded)


class NxDIQwen2VLRotary(torch.nn.Module):
    """NxDI's qwen2_vl/modeling_qwen2_vl_text.py NeuronQwen2VLRotaryEmbedding (cd3abf3
    lines 55-80, ef2731e 75-100): inverse frequencies of head_dim = hidden / heads, and
    a forward that indexes position_ids[None, :, None, :], so [B, S] positions become
    three equal sections and [3, B, S] ones a wrong shape."""

    def __init__(self, config) -> None:
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        self.attention_scaling = 1.0
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, None, :, None].expand(3, position_ids.shape[0], -1, 1)
        freqs = (inv.float() @ position_ids[None, :, None, :].float()).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class NxDIImageToTextWrapper:
    """models/image_to_text_model_wrapper.py ImageToTextModelWrapper.input_generator
    (cd3abf3 lines 243-308, ef2731e 244-309): per bucket 24 inputs, the 21st
    (rotary_position_ids) traced as an empty tensor."""

    def __init__(self, buckets, batch):
        self.buckets, self.batch = buckets, batch

    def input_generator(self):
        return [
            (torch.zeros((self.batch, bucket), dtype=torch.int32), *[torch.empty(0)] * 21,
             torch.zeros(self.batch, 8, 4), torch.zeros(self.batch, bucket, 1))
            for bucket in self.buckets
        ]


def qwen2_vl_text_module() -> types.ModuleType:
    """A stand-in of qwen2_vl/modeling_qwen2_vl_text.py: its rotary embedding, and its
    text wrapper that inherits the image-to-text input_generator (no own one)."""
    module = types.ModuleType("modeling_qwen2_vl_text")
    module.NeuronQwen2VLRotaryEmbedding = NxDIQwen2VLRotary
    module.Qwen2VLTextModelWrapper = type("Qwen2VLTextModelWrapper",
                                          (NxDIImageToTextWrapper,), {})
    return module


def test_mrope_patch_rotates_each_section_by_its_own_row_and_traces_them():
    text = qwen2_vl_text_module()
    found = modules(vision_text=(text,))
    config = types.SimpleNamespace(hidden_size=16, num_attention_heads=2, rope_theta=1e4)
    embedding = text.NeuronQwen2VLRotaryEmbedding(config)
    rows = torch.tensor([[[0, 1, 2, 3]], [[0, 4, 4, 6]], [[0, 9, 1, 2]]])
    two_d = [embedding(torch.zeros(1), rows[i]) for i in range(3)]  # before the patch
    evidence = qwen2_vl_mrope.probe(found)
    assert "broadcasts" in evidence and "traces rotary_position_ids empty" in evidence
    assert qwen2_vl_mrope.apply(found) and not qwen2_vl_mrope.apply(found)
    assert qwen2_vl_mrope.probe(found) is None
    cos, sin = embedding(torch.zeros(1), rows)
    assert cos.shape == (3, 1, 4, 8)
    for i, (row_cos, row_sin) in enumerate(two_d):
        assert torch.allclose(cos[i], row_cos[0]) and torch.allclose(sin[i], row_sin[0])
    assert torch.equal(embedding(torch.zeros(1), rows[0])[0], two_d[0][0])  # 2-D: as shipped
    examples = text.Qwen2VLTextModelWrapper(buckets=[4, 8], batch=2).input_generator()
    assert [tuple(e[21].shape) for e in examples] == [(3, 2, 4), (3, 2, 8)]
    assert all(e[21].dtype == torch.int32 and len(e) == 24 for e in examples)
    assert qwen2_vl_mrope.probe(modules()) is None  # a release without Qwen2-VL
