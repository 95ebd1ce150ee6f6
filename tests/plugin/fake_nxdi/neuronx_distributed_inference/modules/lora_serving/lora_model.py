"""modules/lora_serving/lora_model.py: LoraModelManager as the plugin drives it (ef2731e
lines 439-682; 0.7/0.8 differ where noted).

- Adapter ids: every start-up adapter (lora_ckpt_paths, and lora_ckpt_paths_cpu with
  dynamic_multi_lora) gets an integer id in order, from 1 with enable_base_model_only
  (id 0 is the zero base adapter) else from 0 (init_adapter_id_mapping);
  convert_adapter_id_to_index(name) is that id (a KeyError for an unknown name).
- Caches: a CPU cache (`cpu_adapter_cache`, max_cpu_loras entries) and a device cache
  (`device_adapter_cache`, max_loras entries), each an adapter-id -> position table
  (`map`) evicting the least recently used entry other than the base adapter when full
  (AdapterCache, lru policy, lines 300-438; get_swap_position takes the first free
  position, else evicts; access_adapter is a membership test; remove_adapter is
  `del self.map[adapter_id]`, a KeyError when absent). Both are keyed by the adapter's
  id, which is keyed by its name: a name NxDI has mapped keeps its id for good.
- add_adapter(lora_request): 0.9 maps the name to an id (a new one for a new name) and,
  unless the CPU cache holds that id already (then it reads nothing, whatever the
  path), streams the adapter in (add_new_cpu_adapter, 614-626): a path that is gone
  raises FileNotFoundError after the name was mapped (lora_checkpoint.py
  load_streaming_ckpt); 0.7 and 0.8 return True and load nothing (558-559).
- remove_adapter(adapter_id): removes it from the CPU cache only (`del self.map[...]`: a
  KeyError when absent).
- dynamic_update_weights_for_lora(device_weights, adapter_ids): each id into the CPU
  cache (a miss streams it from lora_ckpt_paths_cpu[name], a KeyError for a streamed
  adapter it no longer holds) and the device cache (a miss writes its weights into the
  device weights at the swapped position, rank_swap); returns the ids' device positions.
Weights here are one value per adapter (checkpoint.signature) in the module
"lora.weight" of each rank's device weights."""

import time
from collections import OrderedDict

import torch

from neuronx_distributed_inference._release import RELEASE

from .checkpoint import signature

STREAMS_ADAPTERS = RELEASE.startswith("0.9")
MODULE = "lora.weight"


class _Cache:
    """AdapterCache (lru): adapter id -> position (`map`), the base adapter 0 never
    evicted."""

    def __init__(self, capacity, ids, base_only):
        self.capacity = capacity
        self.base_only = base_only
        self.map = OrderedDict()
        for position, adapter_id in enumerate(([0] if base_only else []) + list(ids)):
            self.map[adapter_id] = position

    def access_adapter(self, adapter_id):
        return adapter_id in self.map

    def hit(self, adapter_id):
        """access_adapter, then update_adapter on a hit (its recency)."""
        if adapter_id in self.map:
            self.map.move_to_end(adapter_id)
            return True
        return False

    def insert(self, adapter_id):
        """get_swap_position, then add_adapter: the position the adapter takes."""
        used = set(self.map.values())
        free = [p for p in range(self.capacity) if p not in used]
        if free:
            position = free[0]
        else:
            victim = next(a for a in self.map if not (self.base_only and a == 0))
            position = self.map.pop(victim)
        self.map[adapter_id] = position
        return position

    def remove_adapter(self, adapter_id):
        del self.map[adapter_id]


class LoraModelManager:
    def __init__(self, config):
        self.lora_config = config
        self.base_only = config.enable_base_model_only
        self.ckpt_paths = dict(config.lora_ckpt_paths)
        self.ckpt_paths_cpu = dict(config.lora_ckpt_paths_cpu)
        self.lora_adapter_id_mapping = {}
        self.lora_adapter_name_mapping = {}
        self.global_adapter_id = 1 if self.base_only else 0
        for name in {**self.ckpt_paths, **self.ckpt_paths_cpu}:
            self.add_adapter_mapping(name)
        cpu_ids = [self.lora_adapter_id_mapping[n] for n in self.ckpt_paths_cpu]
        device_ids = [self.lora_adapter_id_mapping[n] for n in self.ckpt_paths]
        self.cpu_adapter_cache = _Cache(config.max_cpu_loras, cpu_ids, self.base_only)
        self.device_adapter_cache = _Cache(config.max_loras, device_ids, self.base_only)
        # adapter id -> its weights on the CPU (one value, see checkpoint)
        self.cpu_weights = {self.lora_adapter_id_mapping[n]: signature(p)
                            for n, p in self.ckpt_paths_cpu.items()}
        if self.base_only:
            self.cpu_weights[0] = 0.0
        self.swaps = []  # test instrumentation: (adapter id, device position) written
        self.model = None  # the context-encoding model (init_dynamic_multi_lora)

    def init_dynamic_multi_lora(self, cpu_weights, model):
        """Keeps `model`, the context-encoding model whose modules streamed adapters are
        loaded into (lora_model.py init_dynamic_multi_lora)."""
        self.model = model

    def add_adapter_mapping(self, name):
        if name not in self.lora_adapter_id_mapping:
            self.lora_adapter_id_mapping[name] = self.global_adapter_id
            self.lora_adapter_name_mapping[self.global_adapter_id] = name
            self.global_adapter_id += 1

    def convert_adapter_id_to_index(self, adapter_ids):
        return self.lora_adapter_id_mapping[adapter_ids]

    def device_weights(self):
        """The start-up adapters' weights at their device positions (update_weights_for_
        lora: torch.zeros of [max_loras], checkpoint i at i + enable_base_model_only)."""
        weights = torch.zeros(self.lora_config.max_loras)
        for i, path in enumerate(self.ckpt_paths.values()):
            weights[i + self.base_only] = signature(path)
        return weights

    def _insert_cpu(self, adapter_id, weights=None):
        if self.cpu_adapter_cache.hit(adapter_id):
            return
        if weights is None:
            name = self.lora_adapter_name_mapping[adapter_id]
            weights = signature(self.ckpt_paths_cpu[name])
        self.cpu_adapter_cache.insert(adapter_id)
        self.cpu_weights[adapter_id] = weights

    if STREAMS_ADAPTERS:
        def add_new_cpu_adapter(self, adapter_name, adapter_path):
            self.add_adapter_mapping(adapter_name)
            adapter_id = self.lora_adapter_id_mapping[adapter_name]
            weights = None
            if not self.cpu_adapter_cache.access_adapter(adapter_id):
                weights = signature(adapter_path)
                # lora_checkpoint.py load_streaming_ckpt(self.model, ...) then walks the
                # model's modules (ef2731e lines 37-66)
                self.model.named_modules()
            self._insert_cpu(adapter_id, weights)
            return True

        def add_adapter(self, lora_request) -> bool:
            return self.add_new_cpu_adapter(lora_request.lora_name, lora_request.lora_path)
    else:
        def add_adapter(self, lora_request) -> bool:
            return True

    def remove_adapter(self, adapter_id: int) -> bool:
        self.cpu_adapter_cache.remove_adapter(adapter_id)
        del self.cpu_weights[adapter_id]
        return True

    def dynamic_update_weights_for_lora(self, device_weights, adapter_ids):
        for adapter_id in adapter_ids.tolist():
            self._insert_cpu(adapter_id)
            if not self.device_adapter_cache.hit(adapter_id):
                position = self.device_adapter_cache.insert(adapter_id)
                start = time.monotonic()
                for rank_weights in device_weights:  # rank_swap
                    rank_weights[MODULE][position] = self.cpu_weights[adapter_id]
                self.swaps.append((adapter_id, position, time.monotonic() - start))
        positions = [self.device_adapter_cache.map[a] for a in adapter_ids.tolist()]
        return torch.tensor(positions, dtype=adapter_ids.dtype)
