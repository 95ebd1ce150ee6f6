"""What the double keeps of an adapter's weights: one value per adapter, its `signature`,
which the compiled graphs add to a row's logits peak (see _nxd_runtime), so a row that
gets another adapter's weights, or none, answers differently.

NxDI reads a PEFT folder's adapter_config.json and its weights file, any of .safetensors,
.bin and .pt (lora_checkpoint.py _load_lora_state_dict_from_folder, ef2731e lines
116-131; .bin and .pt through torch.load). The double reads safetensors only and refuses
a folder holding a pickle: it never unpickles, and the plugin must never hand NxDI one."""

import os

from safetensors.torch import load_file


def signature(path: str) -> float:
    """1..97 from the adapter's scaled lora_B weights (scaling lora_alpha / r as
    lora_checkpoint.py _get_module_checkpoint applies it, 161-183)."""
    import json

    if not os.path.exists(path):
        raise FileNotFoundError(f"Invalid checkpoint path {path}.")
    names = os.listdir(path)
    if any(n.endswith((".bin", ".pt")) for n in names):
        raise RuntimeError(f"the NxDI double does not unpickle adapter weights ({path})")
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        raise ValueError(f"No valid LoRA adapter checkpoint in {path}.")
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(path, files[0]))
    scaling = config.get("lora_alpha", 0) / config["r"] if config.get("lora_alpha") else 1.0
    total = sum(float(t.abs().sum()) for k, t in weights.items() if "lora_B" in k)
    return float(1 + int(total * scaling * 1000) % 97)


def adapter_config(path: str) -> dict:
    """config.py _extract_lora_config_from_folder (ef2731e 183-191)."""
    import json

    if "adapter_config.json" not in os.listdir(path):
        raise FileNotFoundError(f"No LoRA configuration json file is found in {path}")
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)
