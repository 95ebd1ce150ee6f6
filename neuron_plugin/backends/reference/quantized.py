"""int8 weight-only quantization on the reference backend, in NxDI's checkpoint layout.

Writing (`write_quantized_checkpoint`, behind `neuron-plugin quantize` on the reference
backend): what NxDI's `save_quantized_state_dict` writes, computed the way
neuronx-distributed's CPU quantizers compute it (quantization_utils.py, observer.py),
checked bit for bit against them: per channel, scale = max|W[row]| / 127 (its
PerChannelAbsMaxObserver); per tensor, scale = max|W| / 127.5 (torch's MinMaxObserver,
qint8 symmetric); scales floored at float32 eps; W_q = clamp(round(W * (1 / scale)),
-128, 127) (torch's quantize kernels multiply by the float32 inverse, which rounds a few
values differently from dividing).
Names and shapes as core.quantization describes: the state dict without `model.`,
`<module>.weight` int8 and `<module>.scale` float32 [out, 1] or [1], one
`model.safetensors` in a folder.

Serving (`load_quantized_weights`): the graph takes the int8 weights and their scales as
inputs (DecoderGraph.linear scales each projection's output); the checkpoint must hold
exactly the modules the settings quantize, in those dtypes and shapes, or it is refused
naming the tensor and the command that rewrites it.

The accuracy this gives against the float model is stated and tested in
tests/e2e/test_quantization.py (docs/configuration/quantization.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from neuron_plugin.backends.reference.architectures import DecoderSpec
from neuron_plugin.backends.reference.decoder import weight_sources
from neuron_plugin.core.checkpoint import replacing_folder, safetensors_files
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.quantization import (
    PER_CHANNEL,
    Quantization,
    check_checkpoint_folder,
    checkpoint_name,
    linear_modules,
)

CHECKPOINT_FILE = "model.safetensors"
_EPS = torch.finfo(torch.float32).eps


def quantize_int8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale [out, 1] or [1]) as neuronx-distributed computes them."""
    w = weight.detach().float()
    if per_channel:
        scale = torch.clamp(w.abs().amax(dim=1, keepdim=True) / 127.0, min=_EPS)
    else:
        scale = torch.clamp(w.abs().amax().reshape(1) / 127.5, min=_EPS)
    quantized = torch.clamp(torch.round(w * (1.0 / scale)), -128, 127).to(torch.int8)
    return quantized, scale.to(torch.float32)


def quantized_modules(
    spec: DecoderSpec, shapes: Mapping[str, Sequence[int]], quantization: Quantization
) -> frozenset[str]:
    """The modules (Hugging Face paths; lm_head) whose weights the checkpoint holds int8."""
    if any(spec.moe_layers):
        raise NeuronConfigError(
            f"override_neuron_config.quantized=true: the reference backend quantizes dense "
            f"decoders only; {spec.architecture} has mixture-of-experts layers (NxDI's "
            f"quantized expert layers run on the nxd backend)."
        )
    if quantization.dtype != "int8":
        raise NeuronConfigError(
            f"override_neuron_config.quantization_dtype={quantization.dtype!r}: the "
            f"reference backend serves int8; use int8 (fp8 runs on the nxd backend)."
        )
    return frozenset(m for m in linear_modules(shapes) if quantization.converts(m))


def _scale_shape(out_features: int, quantization: Quantization) -> list[int]:
    return [out_features, 1] if quantization.type == PER_CHANNEL else [1]


def graph_weight_specs(
    spec: DecoderSpec,
    shapes: Mapping[str, Sequence[int]],
    quantized: frozenset[str],
    quantization: Quantization,
) -> list[tuple[str, list[int], bool]]:
    """(graph input name, shape, int8?) of every weight input, in the graph's order."""
    found = dict(shapes)
    if "lm_head.weight" not in found:  # tied: lm_head quantized from the embedding
        found["lm_head.weight"] = list(shapes["model.embed_tokens.weight"])
    out = []
    for name, _ in weight_sources(spec, quantized):
        module = name.rsplit(".", 1)[0]
        if name.endswith(".scale"):
            out.append((name, _scale_shape(found[module + ".weight"][0], quantization), False))
        else:
            out.append((name, list(found[name]), module in quantized))
    return out


def placeholders(
    spec: DecoderSpec,
    shapes: Mapping[str, Sequence[int]],
    quantized: frozenset[str],
    quantization: Quantization,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Zero weights of the graph's shapes and dtypes, for compiling."""
    return [
        torch.zeros(shape, dtype=torch.int8 if is_int8 else _float(name, dtype))
        for name, shape, is_int8 in graph_weight_specs(spec, shapes, quantized, quantization)
    ]


def _float(name: str, dtype: torch.dtype) -> torch.dtype:
    """Scales stay float32 (NxDI's _cast_helper skips them); other weights: the model's."""
    return torch.float32 if name.endswith(".scale") else dtype


def load_quantized_weights(
    model: str,
    spec: DecoderSpec,
    shapes: Mapping[str, Sequence[int]],
    quantized: frozenset[str],
    quantization: Quantization,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The quantized checkpoint's tensors in the graph's order, each checked."""
    from safetensors.torch import load_file

    folder = check_checkpoint_folder(quantization, model)
    found: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        found.update(load_file(str(path)))
    fix = (
        f"rewrite it with `neuron-plugin quantize {model} --out {folder}` and the same "
        f"override_neuron_config quantization keys"
    )
    tensors = []
    for name, shape, is_int8 in graph_weight_specs(spec, shapes, quantized, quantization):
        stored = checkpoint_name(name)
        tensor = found.get(stored)
        wanted = "int8" if is_int8 else ("float32" if name.endswith(".scale") else "a float")
        ok = tensor is not None and list(tensor.shape) == shape
        ok = ok and (tensor.dtype == torch.int8) == is_int8  # type: ignore[union-attr]
        if not ok:
            held = "no such tensor" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
            raise NeuronConfigError(
                f"quantized checkpoint {folder}: {stored} should be {wanted} {shape} for "
                f"quantization {quantization.describe()}, it holds {held}; {fix}."
            )
        assert tensor is not None  # checked above
        tensors.append(tensor if is_int8 else tensor.to(_float(name, dtype)).contiguous())
    return tensors


def write_quantized_checkpoint(
    model_dir: str | Path, out: str | Path, quantization: Quantization
) -> dict[str, object]:
    """NxDI's quantized checkpoint of `model_dir` as one model.safetensors in folder
    `out` (replaced whole, atomically); what it wrote."""
    from safetensors.torch import load_file, save_file

    files = safetensors_files(model_dir)
    if not files:
        raise NeuronConfigError(
            f"{model_dir} holds no *.safetensors: quantize a safetensors checkpoint."
        )
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    shapes = {name: list(t.shape) for name, t in weights.items()}
    result: dict[str, torch.Tensor] = {}
    converted = []
    for module in linear_modules(shapes):
        if not quantization.converts(module):
            continue
        source = weights.get(f"{module}.weight")
        if source is None:  # lm_head tied to the embedding
            source = weights["model.embed_tokens.weight"]
        q, scale = quantize_int8(source, quantization.type == PER_CHANNEL)
        result[checkpoint_name(module) + ".weight"] = q
        result[checkpoint_name(module) + ".scale"] = scale
        converted.append(module)
    for name, tensor in weights.items():
        stored = checkpoint_name(name)
        if stored not in result:
            result[stored] = tensor.contiguous()
    out = Path(out)
    with replacing_folder(out) as staging:
        save_file(result, str(staging / CHECKPOINT_FILE))
    return {
        "path": str(out),
        "quantization": quantization.describe(),
        "converted": len(converted),
        "bytes": (out / CHECKPOINT_FILE).stat().st_size,
    }
