"""NxDI weight quantization: its `override_neuron_config` keys, the checkpoint layout it
writes, and the device memory it saves.

Keys (NxDI NeuronConfig, models/config.py, 0.7-0.9): `quantized` (bool),
`quantized_checkpoints_path` (where the quantized checkpoint is; NxDI loads the weights
from there only), `quantization_type` (`per_tensor_symmetric` or `per_channel_symmetric`,
the two NxDI's `save_quantized_state_dict` writes), `quantization_dtype` (`int8`, or an
fp8 name), `modules_to_not_convert` (module-name substrings kept in the model dtype).

The checkpoint (what NxDI's `save_quantized_state_dict` writes into an existing folder,
application_base.py 747-799 with neuronx-distributed's quantization_utils): the Hugging
Face model's state dict without its `model.` prefix (`layers.0.self_attn.q_proj.weight`,
`embed_tokens.weight`, `norm.weight`) plus `lm_head.*`; every `nn.Linear` not in
modules_to_not_convert (the attention and MLP projections and lm_head, the latter even
with tied embeddings) as `<module>.weight` int8 and `<module>.scale` float32, [out, 1]
per channel or [1] per tensor; everything else unchanged. The plugin writes and reads it
as safetensors only: NxDI would `torch.save` a pickle where the path is not an existing
folder, and `torch.load` one at load; both are refused.

Backends: nxd serves every type and dtype NxDI does (its quantized layers); the
reference backend serves int8 weight-only, per channel or per tensor (the weights stay
int8 in memory and each projection is scaled after its matmul, as NxDI's
QuantizedColumnParallel / QuantizedRowParallel compute it).

Pure: no vLLM, torch or NxDI import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import pickle_files
from neuron_plugin.core.errors import NeuronConfigError

KEYS = (
    "quantized",
    "quantized_checkpoints_path",
    "quantization_type",
    "quantization_dtype",
    "modules_to_not_convert",
)
PER_CHANNEL, PER_TENSOR = "per_channel_symmetric", "per_tensor_symmetric"
# neuronx-distributed quantization_config.py QuantizationType / QuantizedDtype values
# NxDI's save_quantized_state_dict writes (others raise there).
NXDI_TYPES = (PER_TENSOR, PER_CHANNEL)
NXDI_DTYPES = ("int8", "f8e4m3", "f8e4m3fn", "f8e5m2")
# NxDI's defaults (models/config.py)
DEFAULT_TYPE, DEFAULT_DTYPE = PER_TENSOR, "int8"
# The projections of a decoder layer (nn.Linear in transformers) and the output head.
LINEAR_SUFFIXES = (
    ".self_attn.q_proj",
    ".self_attn.k_proj",
    ".self_attn.v_proj",
    ".self_attn.o_proj",
    ".mlp.gate_proj",
    ".mlp.up_proj",
    ".mlp.down_proj",
)
KEY = "override_neuron_config"


@dataclass(frozen=True)
class Quantization:
    """A resolved weight quantization (see the module docstring)."""

    checkpoint: str
    type: str = DEFAULT_TYPE
    dtype: str = DEFAULT_DTYPE
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_override(cls, override: Mapping[str, Any]) -> Quantization | None:
        """The quantization `override_neuron_config` asks for (None: not quantized),
        each key checked; the checkpoint's folder is checked where it is read."""
        if not override.get("quantized"):
            given = [k for k in KEYS[1:] if override.get(k) is not None]
            if given and override.get("quantized") is None:
                raise NeuronConfigError(
                    f"{KEY} sets {', '.join(given)} without quantized: true, so NxDI would "
                    f'load the unquantized weights; add "quantized": true or remove them.'
                )
            return None
        path = override.get("quantized_checkpoints_path")
        if not path:
            raise NeuronConfigError(
                f"{KEY}.quantized=true needs quantized_checkpoints_path, the folder of the "
                f"quantized checkpoint (NxDI asserts it); name a folder there, and "
                f"`neuron-plugin quantize MODEL [serve flags]` writes it."
            )
        qtype = override.get("quantization_type") or DEFAULT_TYPE
        if qtype not in NXDI_TYPES:
            raise NeuronConfigError(
                f"{KEY}.quantization_type={qtype!r}: NxDI quantizes checkpoints "
                f"{' or '.join(NXDI_TYPES)} (save_quantized_state_dict raises for others); "
                f"use one of them."
            )
        dtype = override.get("quantization_dtype") or DEFAULT_DTYPE
        if dtype not in NXDI_DTYPES:
            raise NeuronConfigError(
                f"{KEY}.quantization_dtype={dtype!r} is not one of {', '.join(NXDI_DTYPES)}."
            )
        keep = override.get("modules_to_not_convert") or ()
        if not isinstance(keep, (list, tuple)) or not all(isinstance(m, str) for m in keep):
            raise NeuronConfigError(
                f"{KEY}.modules_to_not_convert={keep!r} must be a list of module names, "
                f'e.g. ["lm_head"].'
            )
        if keep and qtype == PER_TENSOR:
            raise NeuronConfigError(
                f"{KEY}.modules_to_not_convert={list(keep)!r} has no effect with "
                f"quantization_type={PER_TENSOR!r}: NxDI's per-tensor quantizer converts "
                f"every linear module (quantize_pytorch_model_per_tensor_symmetric); use "
                f"{PER_CHANNEL!r} or remove modules_to_not_convert."
            )
        return cls(str(path), qtype, dtype, tuple(keep))

    def converts(self, module: str) -> bool:
        """Whether NxDI quantizes `module` (a module path of the Hugging Face model):
        modules_to_not_convert entries match as substrings (neuronx-distributed
        quantization_utils._normalize_modules_to_not_convert_paths); the list is empty
        per tensor (refused in from_override)."""
        return not any(entry in module for entry in self.modules_to_not_convert)

    def describe(self) -> str:
        kept = (
            f", {', '.join(self.modules_to_not_convert)} kept in the model dtype"
            if self.modules_to_not_convert
            else ""
        )
        return f"{self.dtype} {self.type.replace('_', ' ')}{kept}"


def linear_modules(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The Hugging Face model's nn.Linear modules NxDI quantizes, by module path: every
    decoder projection and lm_head (present even with tied embeddings)."""
    modules = [
        name.removesuffix(".weight")
        for name in shapes
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(LINEAR_SUFFIXES)
    ]
    return [*sorted(modules), "lm_head"]


def checkpoint_name(module: str) -> str:
    """NxDI's name of a module in its quantized checkpoint: the model's state dict
    without the `model.` prefix, lm_head as is (model_base.prepare_quantized_state_dict)."""
    return module.removeprefix("model.")


def quantized_weight_bytes(
    shapes: Mapping[str, Sequence[int]], quantization: Quantization, dtype_bytes: int
) -> tuple[int, int]:
    """(bytes of the weights unquantized, bytes quantized) over the whole checkpoint:
    quantized linears take one byte a weight plus a float32 scale per output row (per
    channel) or per matrix (per tensor); the rest keeps the model dtype."""
    full = sum(math.prod(s) for s in shapes.values()) * dtype_bytes
    saved = 0
    for module in linear_modules(shapes):
        if not quantization.converts(module):
            continue
        source = f"{module}.weight" if module != "lm_head" else "lm_head.weight"
        shape = shapes.get(source) or shapes.get("model.embed_tokens.weight")
        if shape is None:
            continue
        out_features = shape[0]
        scales = out_features if quantization.type == PER_CHANNEL else 1
        tied = source not in shapes  # lm_head quantized from the tied embedding
        before = 0 if tied else math.prod(shape) * dtype_bytes
        saved += before - (math.prod(shape) + 4 * scales)
    return full, full - saved


def check_output_folder(quantization: Quantization, model: str) -> Path:
    """Where `neuron-plugin quantize` may write: a new or empty folder, or one holding
    only a previous checkpoint's *.safetensors, never the model's folder or one above
    it (writing replaces what the folder holds)."""
    path = Path(quantization.checkpoint).expanduser()
    where = f"{KEY}.quantized_checkpoints_path={str(path)!r}"
    model_dir = Path(model).expanduser().resolve()
    if path.resolve() == model_dir or path.resolve() in model_dir.parents:
        raise NeuronConfigError(
            f"{where} is the model's folder or contains it ({model}); writing the quantized "
            f"checkpoint there would replace the model's files: name a folder of its own."
        )
    if path.is_file() or path.is_symlink():
        raise NeuronConfigError(f"{where} is a file or a link: name a folder.")
    if path.is_dir():
        other = sorted(p.name for p in path.iterdir() if p.suffix != ".safetensors")
        if other:
            raise NeuronConfigError(
                f"{where} holds {', '.join(other[:5])}, not a quantized checkpoint's "
                f"*.safetensors only; writing there would replace them: name a new or "
                f"empty folder."
            )
    return path


def check_checkpoint_folder(quantization: Quantization, model: str) -> Path:
    """The quantized checkpoint's folder, refused where it would not load as safetensors."""
    path = Path(quantization.checkpoint)
    fix = (
        f"write it with `neuron-plugin quantize {model} [the serve flags you use]`, which "
        f"writes quantized_checkpoints_path"
    )
    if path.is_file():
        raise NeuronConfigError(
            f"{KEY}.quantized_checkpoints_path={str(path)!r} is a file: NxDI torch.loads a "
            f"file (a pickle, which can run code); give a folder of safetensors instead: {fix}."
        )
    if not path.is_dir() or not list(path.glob("*.safetensors")):
        raise NeuronConfigError(
            f"{KEY}.quantized_checkpoints_path={str(path)!r} holds no quantized checkpoint "
            f"(*.safetensors); {fix}."
        )
    pickles = pickle_files(path)
    if pickles:
        raise NeuronConfigError(
            f"{KEY}.quantized_checkpoints_path={str(path)!r} also holds {', '.join(pickles)}, "
            f"which NxDI's loader would unpickle; remove them."
        )
    return path
