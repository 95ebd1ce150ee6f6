"""Multi-LoRA on the nxd backend: the plugin's adapter slots as NxDI's LoRA serving.

What NxDI does (modules/lora_serving/, NxDI 0.7-0.9; lines of ef2731e):
- `NeuronConfig(lora_config=dict)` builds a `LoraServingConfig` (models/config.py
  356-358). Its constructor widens `target_modules` to the union of the start-up
  adapters' and raises `max_lora_rank` to their largest r, with a warning only
  (config.py 64-79): the plugin checks those adapters first, so the compiled shapes are
  always vLLM's --max-loras / --max-lora-rank / --lora-target-modules.
- Each targeted layer holds `weight [max_loras, ...]`, zero where no adapter was loaded
  (lora_checkpoint.py update_weights_for_lora, step 3), and `weight_active
  [batch_size, ...]`. A context encoding copies `weight[adapter_ids]` into
  `weight_active[seq_ids]` (lora_layer.py update_lora_tensor_for_continuous_batching); a
  decode reads `weight_active[seq_id]`: a row's adapter is fixed by its prefill, like
  its KV cache line (lora_model.py update_lora_adapter_ids returns seq_ids).
- `adapter_ids` [batch] are indices: `LoraModelManager.convert_adapter_id_to_index(name)`
  of an adapter listed in `lora_ckpt_paths` (its position, from 1 with
  `enable_base_model_only`, 0.9 only, which keeps index 0 zero).
- Run-time loading (`dynamic_multi_lora`): `LoraModelManager.add_adapter(request)` streams
  a new adapter from its folder into NxDI's CPU cache in 0.9 (`add_new_cpu_adapter`,
  lora_model.py 614-626); 0.7 and 0.8 return True and load nothing. Every
  context-encoding call then swaps the call's adapters into device slots and translates
  their ids (model_base.py 3348-3356, `dynamic_update_weights_for_lora`), writing into
  `nxd_model.weights`, which exists on a device only. NxDI's CPU mode cannot run LoRA at
  all (cpu_mode.requested refuses it).

So: with NxDI 0.9 on a device the plugin loads adapters at run time through NxDI's own
path (its slot writes become `add_adapter`, its slot evictions `remove_adapter`, so NxDI's
CPU cache holds exactly the plugin's slots and never evicts on its own), each adapter
under a name that carries vLLM's lora_int_id (`nxdi_name`: NxDI keys everything by
name and never reloads one it holds); an adapter NxDI fails to load leaves its slot
empty and raises AdapterError (`NxDAdapters.set`); otherwise it
serves the adapters listed in `override_neuron_config.lora_config.lora_ckpt_paths` and
says so at start-up. Rows without an adapter index a zero slot: NxDI's base slot 0 where
`enable_base_model_only` exists, otherwise one slot beyond the adapters (never loaded).
The contiguous KV layout only: `weight_active` is indexed by seq_id, which the block
layout does not keep per request.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import AdapterLoading
from neuron_plugin.core.adapters import AdapterError, AdapterWeights
from neuron_plugin.core.checkpoint import pickle_files
from neuron_plugin.core.lora import expand_target_modules
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

logger = plugin_logger(__name__)

KEY = "override_neuron_config.lora_config"


@dataclass(frozen=True)
class NxDILora:
    """What the installed NxDI's LoRA serving can do, probed from its classes."""

    streams_adapters: bool  # LoraModelManager.add_new_cpu_adapter (0.9)
    base_model_slot: bool  # LoraServingConfig(enable_base_model_only=...) (0.9)

    @classmethod
    def probe(cls, serving_config: type, model_manager: type) -> NxDILora:
        parameters = inspect.signature(serving_config).parameters
        return cls(
            streams_adapters=hasattr(model_manager, "add_new_cpu_adapter"),
            base_model_slot="enable_base_model_only" in parameters,
        )


def nxdi_name(adapter: AdapterWeights) -> str:
    """The name NxDI knows a run-time adapter by. NxDI keys its adapter ids, its CPU
    cache and its device cache by name (lora_model.py add_adapter_mapping,
    add_new_cpu_adapter, insert_device_adapter, ef2731e lines 451-471, 586-626) and never
    reloads a name it holds, while vLLM identifies an adapter by lora_int_id: a name
    loaded again from another folder after /v1/unload_lora_adapter gets a new id
    (entrypoints/openai/models/serving.py). So the id is part of the name: new weights
    are a new NxDI adapter, and two slots never share one."""
    return f"{adapter.name}@{adapter.adapter_id}"


def _release(manager: Any, name: str) -> None:
    """Take adapter `name` out of NxDI's CPU cache if NxDI holds it there: its
    remove_adapter raises KeyError for an adapter it does not hold (lora_model.py
    AdapterCache.remove_adapter, `del self.map[adapter_id]`)."""
    try:
        adapter_id = manager.convert_adapter_id_to_index(name)
    except KeyError:
        return  # never mapped
    if manager.cpu_adapter_cache.access_adapter(adapter_id):
        manager.remove_adapter(adapter_id)


@dataclass
class _Request:
    """What NxDI's LoraModelManager.add_adapter reads of vLLM's LoRARequest."""

    lora_name: str
    lora_path: str


def check_start_adapters(settings: NeuronSettings) -> dict[str, str]:
    """The adapters NxDI loads at start, each checked against the compiled slots before
    NxDI reads it (it would widen the shapes, or unpickle a .bin): name -> folder."""
    paths = dict(settings.lora_options.get("lora_ckpt_paths") or {})
    checked = {}
    for name, given in paths.items():
        folder = Path(given).expanduser()
        config_file = folder / "adapter_config.json"
        if not config_file.is_file():
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) has no "
                f"adapter_config.json; give the folder PEFT's save_pretrained wrote."
            )
        pickles = pickle_files(folder)
        if pickles or not list(folder.glob("*.safetensors")):
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) must hold its weights "
                f"as safetensors only (found {', '.join(pickles) or 'no *.safetensors'}); "
                f"NxDI unpickles .bin/.pt files, which can run code: convert them."
            )
        try:
            config = json.loads(config_file.read_text())
            rank = int(config.get("r", 0))
        except (ValueError, TypeError, AttributeError) as exc:
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) has an unreadable "
                f"adapter_config.json ({exc}); give the folder PEFT's save_pretrained wrote."
            ) from exc
        if rank > settings.max_lora_rank:
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) has rank {rank}, above "
                f"--max-lora-rank {settings.max_lora_rank}; restart with --max-lora-rank "
                f"{rank} or more."
            )
        listed = config.get("target_modules") or []
        if isinstance(listed, str):
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) gives target_modules as "
                f"a pattern ({listed[:80]!r}); NxDI reads it as a list of module names "
                f"(modules/lora_serving/config.py LoraServingConfig: set(target_modules) "
                f"takes a string letter by letter): save the adapter with the module "
                f"names listed."
            )
        targets = set(expand_target_modules(listed))
        outside = sorted(targets - set(settings.lora_target_modules))
        if outside:
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) trains {', '.join(outside)}, "
                f"outside --lora-target-modules ({', '.join(settings.lora_target_modules)}); "
                f"add them to --lora-target-modules."
            )
        patterns = [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
        if patterns:
            raise NeuronConfigError(
                f"{KEY}.lora_ckpt_paths: adapter {name!r} ({given}) sets "
                f"{'/'.join(patterns)}, which NxDI ignores (it scales every module by "
                f"lora_alpha / r, at rank r); retrain it with one rank and alpha."
            )
        checked[name] = str(folder.resolve())
    return checked


def start_adapters_fingerprint(start: Mapping[str, str]) -> str:
    """The content of the adapters NxDI loads at start (name -> folder, in NxDI's id
    order), for the cache key of artifacts that embed them (save_sharded_checkpoint:
    NxDI shards the start adapters' weights with the model's, neuronx-distributed
    trace.py shard_children -> update_weights_for_lora): each adapter's name, weight
    files (every byte) and adapter_config.json (its scaling)."""
    from compile_cache.weights import weights_fingerprint

    digest = hashlib.sha256(b"start-adapters-v1\0")
    for name, folder in start.items():
        config = hashlib.sha256((Path(folder) / "adapter_config.json").read_bytes()).hexdigest()
        weights = weights_fingerprint(folder, full=True)
        digest.update(f"{name}\0{weights}\0{config}\0".encode())
    return digest.hexdigest()


class NxDAdapters:
    """The plugin's adapter slots mapped onto NxDI's LoRA serving (see the module
    docstring)."""

    def __init__(self, settings: NeuronSettings, nxdi: NxDILora, version: str):
        options = settings.lora_options
        if settings.is_block_layout:
            raise NeuronConfigError(
                "--enable-lora on the nxd backend needs the contiguous KV layout: NxDI keeps "
                "each request's adapter weights in weight_active[seq_id] from its prefill, and "
                "the block layout keeps no seq_id per request; remove --enable-prefix-caching "
                "/ --enable-chunked-prefill, or use the reference backend."
            )
        if tuple(settings.token_generation_batches) != (settings.max_num_seqs,):
            raise NeuronConfigError(
                "--enable-lora on the nxd backend with override_neuron_config."
                "token_generation_batches: NxDI's weight_active holds one row per sequence "
                "of the full batch; remove token_generation_batches."
            )
        wanted = options.get("dynamic_multi_lora")
        reasons = []
        if not nxdi.streams_adapters:
            reasons.append(
                f"NxD Inference {version} cannot load adapters at run time (its "
                f"LoraModelManager.add_adapter loads nothing before 0.9)"
            )
        if wanted and reasons:
            raise NeuronConfigError(
                f"{KEY}.dynamic_multi_lora=true cannot work: {'; '.join(reasons)}; remove it "
                f"and list the adapters in {KEY}.lora_ckpt_paths."
            )
        self.dynamic = not reasons and wanted is not False
        self.settings = settings
        self.nxdi = nxdi
        self.start = check_start_adapters(settings)
        why = "; ".join(reasons) or f"{KEY}.dynamic_multi_lora is false"
        self.loading = AdapterLoading(
            at_run_time=self.dynamic, at_start=self.start, why="" if self.dynamic else why
        )
        if not self.dynamic:
            logger.warning(
                "nxd backend: LoRA adapters cannot be loaded at run time (%s); serving the "
                "adapters given at start in %s.lora_ckpt_paths: %s",
                why,
                KEY,
                ", ".join(f"{n}={p}" for n, p in self.start.items()) or "none",
            )
        # Rows without an adapter: NxDI's base slot 0, or the zero slot past the adapters.
        self.base_index = 0 if nxdi.base_model_slot else settings.max_loras
        self._index = np.full(settings.lora_slots, self.base_index, dtype=np.int64)
        self._names: dict[int, str] = {}  # plugin slot -> adapter name held there

    def config_kwargs(self) -> dict[str, Any]:
        """NxDI's LoraServingConfig keyword arguments."""
        s = self.settings
        kwargs: dict[str, Any] = {
            k: v for k, v in s.lora_options.items() if k not in ("lora_ckpt_paths",)
        }
        kwargs.update(
            # without NxDI's base slot, one zero slot beyond the adapters
            max_loras=s.max_loras if self.nxdi.base_model_slot else s.max_loras + 1,
            max_lora_rank=s.max_lora_rank,
            # NxDI's CPU cache holds exactly the adapters in the plugin's slots
            max_cpu_loras=s.max_loras,
            batch_size=s.max_num_seqs,
            target_modules=list(s.lora_target_modules),
            lora_ckpt_paths=dict(self.start),
            dynamic_multi_lora=self.dynamic,
            base_model_quantized=bool(s.passthrough.get("quantized", False)),
        )
        if self.nxdi.base_model_slot:
            kwargs["enable_base_model_only"] = True
        return kwargs

    def set(self, model: Any, slot: int, adapter: AdapterWeights) -> None:
        """The plugin's slot `slot` now holds `adapter`: NxDI streams it in (run-time
        loading, the slot's previous adapter leaving NxDI's CPU cache), or it is one of
        the adapters NxDI loaded at start. An adapter NxDI cannot load raises
        AdapterError naming it and why; the slot is then empty (its rows run the base
        model) and NxDI holds exactly the adapters of the other slots, so the next
        adapter written anywhere loads as usual."""
        manager = model.lora_model_manager
        refusal = self.loading.refusal(adapter.name, adapter.path)
        if refusal is not None:
            raise AdapterError(refusal)
        if not self.dynamic:
            self._names[slot] = adapter.name
            self._index[slot] = manager.convert_adapter_id_to_index(adapter.name)
            return
        name = nxdi_name(adapter)
        if self._names.get(slot) == name:
            return  # NxDI holds it for this slot already
        previous = self._names.pop(slot, None)
        self._index[slot] = self.base_index
        for other, held in list(self._names.items()):
            if held == name:  # the adapter moves here from another slot
                del self._names[other]
                self._index[other] = self.base_index
        if previous is not None:
            _release(manager, previous)
        cause: Exception | None = None
        try:
            loaded = manager.add_adapter(_Request(name, adapter.path))
            why = "" if loaded else "LoraModelManager.add_adapter returned False"
        except Exception as exc:  # NxDI's loader: missing files, bad tensors, ...
            cause, why = exc, f"{type(exc).__name__}: {exc}"
        if why:
            _release(manager, name)  # whatever of it NxDI kept
            raise AdapterError(
                f"LoRA adapter {adapter.name!r} (id {adapter.adapter_id}) from "
                f"{adapter.path}: NxD Inference could not load it ({why}); its requests "
                f"fail, other adapters and the base model keep serving."
            ) from cause
        self._names[slot] = name
        self._index[slot] = manager.convert_adapter_id_to_index(name)

    def adapter_ids(self, slots: np.ndarray | None, rows: int) -> np.ndarray:
        """NxDI's adapter_ids [rows] for the rows' plugin slots (None: all base)."""
        if slots is None:
            return np.full(rows, self.base_index, dtype=np.int64)
        return self._index[slots]
