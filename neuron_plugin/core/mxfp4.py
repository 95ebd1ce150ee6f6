"""MXFP4, the format openai ships gpt-oss's expert weights in (`quantization_config`
quant_method "mxfp4"): per output row, groups of 32 inputs share a power-of-two scale
(a uint8 exponent, 127 meaning 2**0) and each value is a 4-bit FP4 (e2m1) code, two codes
a byte with the even input in the low nibble. A checkpoint holds `NAME_blocks`
[experts, out, in/32, 16] and `NAME_scales` [experts, out, in/32] where an unquantized
one holds `NAME` [experts, in, out] (transformers' GptOssExperts layout).

Every dequantized value (an FP4 value times a power of two) is exact in float32 and
bfloat16, so the float weights are the checkpoint's whatever the serving dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch

GROUP = 32  # inputs per shared scale
SCALE_BIAS = 127
# The value of each FP4 (e2m1) code: 3 magnitude bits, bit 3 the sign.
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = MAGNITUDES + tuple(-m for m in MAGNITUDES)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [experts, in, out] of MXFP4 `blocks` and `scales`."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
            f"pair: blocks must be scales' shape plus a last dimension of {GROUP // 2} bytes"
        )
    table = torch.tensor(FP4_VALUES)
    codes = blocks.to(torch.uint8)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    rows = torch.ldexp(values.flatten(-2), exponents[..., None])  # [experts, out, groups, 32]
    return rows.flatten(-2).transpose(1, 2).contiguous()


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `weight` [experts, in, out]: each group's scale is the smallest
    power of two that fits its largest magnitude into FP4's 6.0, each value the nearest
    FP4 value (used to write checkpoints as openai ships them)."""
    rows = weight.transpose(1, 2).float()  # [experts, out, in]
    if rows.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs inputs in groups of {GROUP}; got {rows.shape[-1]}")
    groups = rows.reshape(*rows.shape[:2], -1, GROUP)
    largest = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponents)[..., None]
    magnitudes = torch.tensor(MAGNITUDES)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponents + SCALE_BIAS).to(torch.uint8)


def dequantized_shapes(shapes: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Tensor shapes (from safetensors headers) with every MXFP4 pair replaced by its
    float weight's [experts, in, out]."""
    out = {n: s for n, s in shapes.items() if not n.endswith((BLOCKS, SCALES))}
    for name, (experts, rows, groups, _) in (
        (n.removesuffix(BLOCKS), s) for n, s in shapes.items() if n.endswith(BLOCKS)
    ):
        out[name] = [experts, groups * GROUP, rows]
    return out


def dequantize_pairs(tensors: MutableMapping[str, torch.Tensor]) -> list[str]:
    """Replace every `NAME_blocks` / `NAME_scales` pair in `tensors` by the float32
    `NAME`; returns the names dequantized."""
    names = [n.removesuffix(BLOCKS) for n in tensors if n.endswith(BLOCKS)]
    for name in names:
        if name + SCALES not in tensors:
            raise ValueError(f"MXFP4 tensor {name}{BLOCKS} has no {name}{SCALES} beside it")
        tensors[name] = dequantize(tensors.pop(name + BLOCKS), tensors.pop(name + SCALES))
    return names
