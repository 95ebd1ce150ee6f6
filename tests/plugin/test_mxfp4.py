"""gpt-oss as openai ships it: MXFP4 experts (core/mxfp4.py), written by the tiny-model
builder, read by the reference backend as transformers reads them, and the checkpoint's
quantization_config (quant_method mxfp4) accepted for gpt-oss alone."""

from __future__ import annotations

import pytest
import torch

from neuron_plugin.core import mxfp4
from neuron_plugin.core.vllm_flags import flag_problems


def test_dequantize_hand_worked():
    # one row, one group of 32: codes 1 (0.5) and 0xA (-1.0) alternating, scale 2**1
    blocks = torch.full((1, 1, 1, 16), 0xA1, dtype=torch.uint8)
    scales = torch.tensor([[[128]]], dtype=torch.uint8)
    weight = mxfp4.dequantize(blocks, scales)
    assert weight.shape == (1, 32, 1)  # [experts, in, out]
    assert weight[0, :4, 0].tolist() == [1.0, -2.0, 1.0, -2.0]


def test_quantize_rounds_to_fp4_under_a_shared_power_of_two():
    weight = torch.tensor([6.0, -3.1, 0.2, 0.0] * 8).reshape(1, 32, 1)
    blocks, scales = mxfp4.quantize(weight)
    assert scales.tolist() == [[[127]]]  # 6.0 fits FP4's largest: 2**0
    assert mxfp4.dequantize(blocks, scales)[0, :4, 0].tolist() == [6.0, -3.0, 0.0, 0.0]
    halved = mxfp4.dequantize(*mxfp4.quantize(weight / 4))
    assert halved[0, :4, 0].tolist() == [1.5, -0.75, 0.0, 0.0]


def test_round_trip_of_what_it_wrote_and_transformers_agree():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(0)) * 0.08
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    ours = mxfp4.dequantize(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(ours)), ours)  # exact values stay
    assert float((ours - weight).norm() / weight.norm()) < 0.2


def test_unpaired_or_misshapen_tensors_are_refused():
    with pytest.raises(ValueError, match="has no x_scales beside it"):
        mxfp4.dequantize_pairs({"x_blocks": torch.zeros(1, 1, 1, 16, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="do not pair"):
        mxfp4.dequantize(torch.zeros(1, 2, 1, 16, dtype=torch.uint8),
                         torch.zeros(1, 1, 1, dtype=torch.uint8))


def test_reference_backend_reads_the_tiny_gpt_oss_as_transformers_does(tiny_model):
    from transformers import AutoModelForCausalLM

    from neuron_plugin.backends.reference.architectures import DecoderSpec
    from neuron_plugin.backends.reference.decoder import load_weights, weight_sources
    from neuron_plugin.core.checkpoint import read_hf_config, safetensors_shapes

    model_dir = tiny_model("gpt_oss")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in safetensors_shapes(model_dir)
    spec = DecoderSpec.from_hf_config(read_hf_config(model_dir))
    weights = dict(zip([n for n, _ in weight_sources(spec)],
                       load_weights(model_dir, spec, torch.float32), strict=True))
    shapes = mxfp4.dequantized_shapes(safetensors_shapes(model_dir))
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == [4, 128, 256]
    assert "model.layers.1.mlp.experts.gate_up_proj_scales" not in shapes
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    experts = hf.model.layers[1].mlp.experts
    assert torch.equal(weights["model.layers.1.mlp.experts.gate_up_proj"],
                       experts.gate_up_proj.float())
    assert list(experts.gate_up_proj.shape) == shapes["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(weights["model.layers.1.mlp.experts.down_proj"],
                       experts.down_proj.float())


def test_mxfp4_quantization_config_is_served_to_gpt_oss_only():
    assert flag_problems({"--quantization": "mxfp4"}, "GptOssForCausalLM") == []
    for value, architecture in (("mxfp4", "LlamaForCausalLM"), ("fp8", "GptOssForCausalLM")):
        found = flag_problems({"--quantization": value}, architecture)
        assert len(found) == 1 and f"--quantization {value}" in found[0]
