"""Run under an interpreter with NxD Inference: the nxd backend's adapter slots on NxDI's
own LoRA serving manager (modules/lora_serving/lora_model.py LoraModelManager, NxDI 0.9).
NxDI's CPU mode cannot run a LoRA graph (cpu_mode.requested), but everything the plugin
drives up to the graph runs here as on a device: the plugin builds NxDI's application
with its LoraServingConfig (NxDBackend._new_model), NxDI builds the context-encoding
module it would trace (DecoderModelInstance.load_module, LoRA layers included), shards
the CPU adapter weights and starts its run-time loading (init_dynamic_multi_lora, as
application_base.load_weights does); `set_adapter` then streams real PEFT folders in
(add_adapter), and NxDI's context-encoding swap (dynamic_update_weights_for_lora) writes
the adapters of a step into device weights of the traced module's LoRA shapes. Used by
test_nxdi_lora.py (which resolves the settings: this side has no vLLM); prints one JSON
object.

NxDI 0.8 (the release inf2/trn1 run) loads no adapter at run time (its add_adapter loads
nothing; init_dynamic_multi_lora takes only the CPU weights): the backend serves the
adapters listed in lora_ckpt_paths, which NxDI writes into the traced module's LoRA
weights at load (lora_checkpoint.py update_weights_for_lora), and refuses any other by
name (`start_adapters_only`).

    python nxdi_lora_probe.py SETTINGS_JSON MODEL_DIR ADAPTERS_JSON
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile

import numpy as np
import torch

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.adapters import AdapterError, AdapterWeights
from neuron_plugin.core.settings import NeuronSettings
from tests.e2e.nxdi_parallel import model_parallel_of_one


def start_adapters_only(backend: NxDBackend, module: torch.nn.Module, checkpoint,
                        adapters: dict[str, str]) -> dict:
    """The start adapter "a" in a slot reads NxDI's weights of "a" (what NxDI loaded at
    start into the module's LoRA weights); rows without an adapter read a zero slot; an
    adapter not given at start is refused naming why."""
    assert backend.adapters is not None
    # as NxDI's loader calls it: on the base model's state dict, without LoRA tensors
    base = {k: v for k, v in module.state_dict().items() if ".lora_" not in k}
    weights = checkpoint.update_weights_for_lora(module, base)
    name = next(n for n in weights if checkpoint.is_lora_module(n.removesuffix(".weight"))
                and "lora_B" in n and not n.endswith("_active"))
    backend.set_adapter(1, AdapterWeights("a", 1, adapters["a"], 8))
    index = int(backend.adapters.adapter_ids(np.array([1]), 1)[0])
    zero = int(backend.adapters.adapter_ids(None, 1)[0])
    report: dict = {"plugin": sys.modules["neuron_plugin"].__file__,
                    "loading": backend.adapters.loading.to_dict(),
                    "start_adapter_loaded": bool(weights[name][index].abs().sum() > 0),
                    "base_slot_zero": bool(weights[name][zero].abs().sum() == 0),
                    "index": index, "base": zero}
    try:
        backend.set_adapter(2, AdapterWeights("z", 5, adapters["c"], 8))
        report["error"] = None
    except AdapterError as exc:
        report["error"] = str(exc)
    return report


def main(settings_json: str, model_dir: str, adapters: dict[str, str]) -> dict:
    settings = NeuronSettings.from_dict(json.loads(settings_json))
    backend = NxDBackend(settings, model_dir)
    application = backend._new_model()
    model_parallel_of_one()
    instance = application.context_encoding_model.get_model_instance()
    instance.load_module()
    module = instance.module
    checkpoint = module.lora_weight_manager.lora_checkpoint
    assert backend.adapters is not None
    if not backend.adapters.dynamic:
        backend.model = application  # what load() sets on a device
        return start_adapters_only(backend, module, checkpoint, adapters)
    checkpoint.update_weights_for_lora_cpu(module)
    manager = application.lora_model_manager
    manager.init_dynamic_multi_lora(checkpoint.shard_cpu_checkpoints(0, 1, 1, module), module)
    backend.model = application  # what load() sets on a device
    state = module.state_dict()
    device = [{name: torch.zeros_like(state[name]) for name in manager.lora_modules}]
    probe_module = manager.lora_modules[1]  # a lora_B: zero where nothing was loaded

    def on_device(slot: int) -> torch.Tensor:
        """What a prefill of the plugin's `slot` reads: NxDI's swap of its adapter."""
        index = torch.from_numpy(adapters_of(slot))
        position = int(manager.dynamic_update_weights_for_lora(device, index)[0])
        return device[0][probe_module][position].clone()

    def adapters_of(slot: int) -> np.ndarray:
        """NxDI's adapter_ids for one row of the plugin's `slot`."""
        assert backend.adapters is not None
        return backend.adapters.adapter_ids(np.array([slot]), 1)

    report: dict = {"plugin": sys.modules["neuron_plugin"].__file__}
    # a name loaded again from another folder (a new lora_int_id), in a second slot
    backend.set_adapter(1, AdapterWeights("x", 1, adapters["a"], 8))
    first = on_device(1)
    backend.set_adapter(2, AdapterWeights("x", 2, adapters["c"], 8))
    second = on_device(2)
    report["reused_name_new_weights"] = bool(second.abs().sum() > 0) and not torch.equal(
        first, second
    )
    report["first_still_served"] = torch.equal(on_device(1), first)
    # an adapter whose folder is gone by the time NxDI re-reads it
    gone = tempfile.mkdtemp()
    shutil.rmtree(gone)
    shutil.copytree(adapters["b"], gone)
    backend.set_adapter(1, AdapterWeights("g", 3, gone, 8))
    backend.set_adapter(1, AdapterWeights("y", 4, adapters["a"], 8))  # g leaves NxDI
    shutil.rmtree(gone)
    try:
        backend.set_adapter(1, AdapterWeights("g", 3, gone, 8))
        report["error"] = None
    except AdapterError as exc:
        report["error"] = str(exc)
    report["slot_1_after_failure"] = int(adapters_of(1)[0])
    report["cpu_cache_after_failure"] = sorted(int(i) for i in manager.cpu_adapter_cache.map)
    report["slot_2_still_served"] = torch.equal(on_device(2), second)
    backend.set_adapter(1, AdapterWeights("y", 4, adapters["a"], 8))
    report["slot_1_reloaded"] = torch.equal(on_device(1), first)
    report["names"] = dict(manager.lora_adapter_id_mapping)
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
