"""A LoRA adapter the validation kit builds when the user gives none: PEFT's file layout
(adapter_config.json + adapter_model.safetensors, what vLLM and NxDI read), random A and
B from a fixed seed over the projections the configuration compiles slots for, scaled so
that it changes the model's tokens without swamping them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from neuron_plugin.core.checkpoint import replacing_folder, safetensors_shapes
from neuron_plugin.core.lora import MODULE_PARENTS

_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")


def build_adapter(
    model_dir: str | Path, out: Path, targets: Sequence[str], rank: int, seed: int = 0
) -> Path:
    """Write the adapter into `out` (replaced whole) and return it."""
    modules = []
    for name, shape in sorted(safetensors_shapes(model_dir).items()):
        match = _WEIGHT.match(name)
        if match and match[3] in targets and MODULE_PARENTS.get(match[3]) == match[2]:
            modules.append((name.removesuffix(".weight"), shape))
    if not modules:
        raise ValueError(f"{model_dir} has no {list(targets)} projections to adapt")
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (rows, cols) in modules:
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = rng.normal(0, cols**-0.5, (rank, cols)).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.5 * rank**-0.5, (rows, rank)).astype(
            np.float32
        )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[1] for m, _ in modules}),
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    with replacing_folder(out) as staging:
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=1))
        save_file(tensors, str(staging / "adapter_model.safetensors"))
    return out
