"""Build small LoRA adapters for a tiny checkpoint with PEFT, for tests and the demo.

PEFT's default initialisation makes lora_B zero (a new adapter changes nothing), so the
adapters here keep PEFT's random A and B (`init_lora_weights=False`) from a fixed seed:
each one changes the model's greedy tokens, differently from the others. They are saved
with PEFT's own `save_pretrained` (adapter_config.json + adapter_model.safetensors, the
layout vLLM and NxDI read). Re-running with the same arguments leaves an existing folder
untouched (a stamp file records the recipe).

    python scripts/build_tiny_lora.py --base models/tiny-llama --out models/lora-a \
        --rank 8 --alpha 16 --seed 1

`ADAPTERS` are those the LoRA tests serve beside the base model: one of rank 8 over every
projection, one of rank 4 over the attention projections and down_proj with rsLoRA
scaling (alpha / sqrt(r)) and a per-module rank and alpha (rank_pattern, alpha_pattern),
so the scaling rules vLLM's PEFTHelper applies are exercised, and a third (rank 8, q and
v only) that must take the slot of one of the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from build_tiny_model import building

from neuron_plugin.core.checkpoint import replacing_folder

RECIPE_VERSION = 1
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig fields of the tests' adapters
ADAPTERS: dict[str, dict[str, Any]] = {
    "lora-a": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES, "seed": 1},
    "lora-b": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
        "use_rslora": True,
        "rank_pattern": {"v_proj": 2},
        "alpha_pattern": {"o_proj": 4},
        "seed": 2,
    },
    "lora-c": {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "seed": 3},
}


def build_lora(
    base: Path, out: Path, *, seed: int, safe_serialization: bool = True, **lora: Any
) -> Path:
    """Write a PEFT adapter of `base` to `out` unless an identical one is there. `lora`
    holds peft.LoraConfig fields (r, lora_alpha, target_modules, use_rslora, ...);
    `safe_serialization=False` writes PEFT's pickled adapter_model.bin instead (a
    format the plugin refuses; for its tests)."""
    base_stamp = base / "tiny_model_recipe.json"
    wanted = {
        "recipe_version": RECIPE_VERSION,
        "base": json.loads(base_stamp.read_text()) if base_stamp.exists() else str(base),
        "seed": seed,
        **({} if safe_serialization else {"safe_serialization": False}),
        **lora,
    }
    with building(out, "tiny_lora_recipe.json", wanted) as stale:
        if stale:
            _write(base, out, wanted, seed, safe_serialization, lora)
    return out


def _write(
    base: Path,
    out: Path,
    wanted: dict[str, Any],
    seed: int,
    safe_serialization: bool,
    lora: dict[str, Any],
) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        **lora,
    )
    peft_model = get_peft_model(model, config)
    with replacing_folder(out) as staging:
        peft_model.save_pretrained(str(staging), safe_serialization=safe_serialization)
        (staging / "tiny_lora_recipe.json").write_text(json.dumps(wanted, indent=2))


def build_test_adapters(base: Path, models: Path) -> dict[str, Path]:
    """The tests' adapters (`ADAPTERS`) of `base`, under models/<base name>-<adapter>."""
    return {
        name: build_lora(base, models / f"{base.name}-{name}", **fields)
        for name, fields in ADAPTERS.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the base checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--target-modules", nargs="+", default=ALL_MODULES, help="projections to adapt"
    )
    parser.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(r)")
    args = parser.parse_args(argv)
    path = build_lora(
        args.base,
        args.out,
        seed=args.seed,
        r=args.rank,
        lora_alpha=args.alpha,
        target_modules=args.target_modules,
        use_rslora=args.rslora,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
