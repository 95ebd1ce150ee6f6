"""modules/lora_serving (NxDI 0.7-0.9): LoRA serving as the plugin drives it: the
LoraServingConfig constructor and its checks (config.py), the LoraModelManager's adapter
ids, run-time loading and slot swapping (lora_model.py), and what a PEFT folder's
weights become (lora_checkpoint.py), reduced to one value per adapter (see checkpoint)."""

from .config import LoraServingConfig
from .lora_model import LoraModelManager

__all__ = ["LoraModelManager", "LoraServingConfig"]
