"""The vision towers as the backend runs them, whichever family's (the Qwen2-VL family
and Qwen3-VL: `families/qwen2_vl.py`; Pixtral: `families/pixtral.py`; Llama 4:
`families/llama4.py`): one fixed-shape graph per vision bucket (core.vision) of
(weights, patches, the image's layout arrays), its weights read from the checkpoint by
the names the tower lists.

An image arrives as its processor's patches; what depends on its grid is computed on the
host (`Tower.image_inputs`) and enters the graph as inputs, so one graph serves every grid
of at most its bucket's patches; padded rows compute garbage that
`LoadedBackend.encode_image` drops.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from neuron_plugin.backends.reference.architecture import UnsupportedModelError
from neuron_plugin.backends.reference.decoder import owned
from neuron_plugin.backends.reference.families import family_module
from neuron_plugin.core.checkpoint import canonical_tensor_name, safetensors_files


class Tower(Protocol):
    """A vision tower's facts, as its family reads them from config.json."""

    patch_dim: int
    spatial_merge_size: int
    merge_patches: int  # a vision bucket holds a multiple of these patches
    embedding_width: int  # values per image embedding (DeepStack levels included)

    def image_inputs(self, grid_thw: np.ndarray, patches: int) -> list[np.ndarray]: ...

    def graph(self) -> nn.Module: ...

    def weight_names(self) -> list[str]: ...


def vision_tower(config: dict[str, Any]) -> Tower:
    """The spec of the checkpoint's vision tower, read by its architecture's family."""
    architectures = config.get("architectures") or [""]
    tower: Tower = family_module(architectures[0]).tower(config)
    return tower


def load_weights(model_dir: str | Path, spec: Tower, dtype: torch.dtype) -> list[torch.Tensor]:
    """The vision tower's tensors of the checkpoint, in `weight_names` order."""
    from safetensors import safe_open

    wanted = set(spec.weight_names())
    found: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is no dict)
                name = canonical_tensor_name(stored)
                if name in wanted:
                    found[name] = f.get_tensor(stored)
    return [owned(found[name], dtype) for name in checked_names(spec, found)]


def weight_shapes(spec: Tower, shapes: Mapping[str, list[int]]) -> list[list[int]]:
    """The vision graph's weight shapes from the checkpoint's (safetensors headers)."""
    return [list(shapes[name]) for name in checked_names(spec, shapes)]


def checked_names(spec: Tower, present: Mapping[str, object]) -> list[str]:
    names = spec.weight_names()
    missing = [n for n in names if n not in present]
    if missing:
        raise UnsupportedModelError(
            f"the checkpoint lacks {len(missing)} tensors of the vision tower, e.g. {missing[:3]}"
        )
    return names
