"""modules/lora_serving/config.py: LoraServingConfig's constructor (ef2731e lines 9-79;
0.7 and 0.8 are the same without enable_base_model_only, 0.9's addition): start-up
adapters as a dict of existing paths, max_loras raised to their count, and target
modules / max_lora_rank widened to what the start-up adapters' adapter_config.json say,
each with a warning only (the shapes then differ from what the caller asked for)."""

import logging
import os

from neuronx_distributed_inference._release import RELEASE

from .checkpoint import adapter_config

HAS_BASE_MODEL_SLOT = RELEASE.startswith("0.9")


class LoraServingConfig:
    if HAS_BASE_MODEL_SLOT:
        def __init__(self, max_loras=1, max_lora_rank=16, max_cpu_loras=100, batch_size=1,
                     target_modules=None, lora_bias="none", lora_ckpt_paths=None,
                     lora_ckpt_paths_cpu=None, lora_ckpt_json=None, lora_memory_transpose=True,
                     lora_shard_linear_layer=True, is_context_encoding=False,
                     dynamic_multi_lora=False, eviction_policy="lru", lfu_decay_period=128,
                     base_model_quantized=False, enable_base_model_only=False):
            self._init(**{k: v for k, v in locals().items() if k != "self"})
    else:
        def __init__(self, max_loras=1, max_lora_rank=16, max_cpu_loras=100, batch_size=1,
                     target_modules=None, lora_bias="none", lora_ckpt_paths=None,
                     lora_ckpt_paths_cpu=None, lora_ckpt_json=None, lora_memory_transpose=True,
                     lora_shard_linear_layer=True, is_context_encoding=False,
                     dynamic_multi_lora=False, eviction_policy="lru", lfu_decay_period=128,
                     base_model_quantized=False):
            self._init(**{k: v for k, v in locals().items() if k != "self"},
                       enable_base_model_only=False)

    def _init(self, max_loras, max_lora_rank, max_cpu_loras, batch_size, target_modules,
              lora_bias, lora_ckpt_paths, lora_ckpt_paths_cpu, lora_ckpt_json,
              lora_memory_transpose, lora_shard_linear_layer, is_context_encoding,
              dynamic_multi_lora, eviction_policy, lfu_decay_period, base_model_quantized,
              enable_base_model_only):
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.batch_size = batch_size
        self.target_modules = target_modules
        self.lora_bias = lora_bias
        self.dynamic_multi_lora = dynamic_multi_lora
        self.eviction_policy = eviction_policy
        self.lfu_decay_period = lfu_decay_period
        self.enable_base_model_only = enable_base_model_only
        if self.enable_base_model_only:
            self.max_loras += 1
            self.max_cpu_loras += 1
        if lora_ckpt_json is not None:
            raise NotImplementedError("the NxDI double does not read lora_ckpt_json")
        self.lora_ckpt_paths = self._to_dict(lora_ckpt_paths)
        self.lora_ckpt_paths_cpu = ((self._to_dict(lora_ckpt_paths_cpu) | self.lora_ckpt_paths)
                                    if self.dynamic_multi_lora else {})
        num_ckpts = len(self.lora_ckpt_paths) + self.enable_base_model_only
        if self.max_loras < num_ckpts:
            logging.warning(f"Setting the number of LoRA adapters in HBM to "
                            f"{len(self.lora_ckpt_paths)}.")
            self.max_loras = num_ckpts
        if (self.dynamic_multi_lora and len(self.lora_ckpt_paths_cpu)
                + self.enable_base_model_only > self.max_cpu_loras):
            raise ValueError("The total number of LoRA checkpoints ... exceeds max_cpu_loras")
        self.lora_memory_transpose = lora_memory_transpose
        self.lora_shard_linear_layer = lora_shard_linear_layer
        self.is_context_encoding = is_context_encoding
        self.base_model_quantized = base_model_quantized
        # get_lora_config_from_ckpt_paths and the widening after it (64-79)
        targets, ranks = set(), [self.max_lora_rank]
        for path in [*self.lora_ckpt_paths.values(), *self.lora_ckpt_paths_cpu.values()]:
            config = adapter_config(path)
            targets.update(config["target_modules"])
            ranks.append(config["r"] if "r" in config else config["lora_rank"])
        if self.target_modules is None or not targets.issubset(set(self.target_modules)):
            logging.warning(f"Setting target modules to {list(targets)} based on the LoRA "
                            f"configurations in checkpoint paths.")
            self.target_modules = list(targets)
        if self.max_lora_rank < max(ranks):
            logging.warning(f"Setting max_lora_rank to {max(ranks)} based on the LoRA "
                            f"configurations in checkpoint paths.")
            self.max_lora_rank = max(ranks)

    @staticmethod
    def _to_dict(paths):
        """convert_ckpt_paths_to_dict: a dict, or "id:path" strings; every path must exist
        and every id be unique (_check_valid_adapter_id_path)."""
        result = {}
        if paths is None:
            return result
        items = (paths.items() if isinstance(paths, dict)
                 else [tuple(p.strip() for p in s.split(":")[:2]) for s in paths])
        for adapter_id, path in items:
            path = os.path.expanduser(path)
            if not os.path.exists(path):
                raise FileNotFoundError(f"LoRA adapter path {path} for adapter ID {adapter_id} "
                                        f"is not found. Please check lora_ckpt_path and try again.")
            if adapter_id in result:
                raise ValueError(f"The adapter ID {adapter_id} appears more than once in "
                                 f"lora_ckpt_paths. Please check lora_ckpt_path and try again.")
            result[adapter_id] = path
        return result
