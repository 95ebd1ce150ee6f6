"""Run under an interpreter with NxD Inference (its CPU mode): NxDI's own
NeuronLlama4ForCausalLM on the tiny Llama 4 checkpoint, in the cases test_nxdi_llama4.py
compares with transformers; prints one JSON object. This is the evidence behind the nxd
backend's refusal of Llama 4, so the model runs as NxDI ships it: its `forward` turns
the vision mask into positions (dummy ones for text), runs the vision encoder and the
text model. The plugin is not involved.

    python nxdi_llama4_probe.py PLAN_JSON OUT_DIR

PLAN: {"model": dir, "bucket": context and token-generation bucket, "vision_bucket":
image chunks per vision-encoder call, "pixel_values": .npy [chunks, 3, size, size],
"image_token": the id the image's features replace, "cases": {name: {"prompt": ids,
"steps": decode steps, "image": bool}}}; a case with "image" prefills with the pixels.
Each case is prefilled, then decoded greedily for its steps: its greedy tokens go in the
report, every step's logits in OUT_DIR/NAME.npy (float32 [steps + 1, vocab]). The
vision encoder's output for the pixel values goes in OUT_DIR/vision.npy ([chunks, tokens
per chunk, text hidden]), that of NxDI's NeuronLlama4ForImageEncoding application (the
same module in its own application) in OUT_DIR/image_encoding.npy.

What NxDI's CPU mode cannot run as shipped gets a stand-in here, and only here, each
listed in the report under "stand_ins" with the NxDI file:function it works around,
after recording what the shipped code does ("shipped_to_cpu", "shipped_forward").
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.e2e.nxdi_vision_probe import (
    Runner,
    error,
    free_master_port,
    run_wrappers_eagerly,
    single_core,
    stand_in,
    text_neuron_config,
)


def nxdi_config(plan: dict[str, Any]) -> Any:
    """NxDI's Llama4InferenceConfig for one context bucket (also the token-generation one,
    so the CPU module's n_positions, set once by to_cpu, is every call's), as NxDI's
    examples/generation_llama4.py builds it: a text and a vision Llama4NeuronConfig."""
    from neuronx_distributed_inference.models.llama4.modeling_llama4 import (
        Llama4InferenceConfig,
        Llama4NeuronConfig,
    )
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    text = text_neuron_config(Llama4NeuronConfig, plan["bucket"])
    vision = Llama4NeuronConfig(**single_core(plan["bucket"]), buckets=[plan["vision_bucket"]])
    return Llama4InferenceConfig(
        text_neuron_config=text,
        vision_neuron_config=vision,
        load_config=load_pretrained_config(plan["model"]),
    )


def shard_at_tp_1(model: Any) -> list[dict[str, str]]:
    """NeuronLlama4ForCausalLM.to_cpu shards the checkpoint (get_sharded_checkpoint, whose
    preshard hooks put the shared experts' weights in NxD's transposed layout) only when
    tp_degree > 1; NeuronApplicationBase.to_cpu, and the builder on a device, always do.
    Here both modules shard before loading (the probe runs TP 1), as those do."""
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    degree = model.neuron_config.tp_degree

    def sharding(cls: type) -> type:
        class Sharded(cls):  # type: ignore[misc, valid-type]
            def load_state_dict(self, state_dict: Any, strict: bool = True, **kw: Any) -> Any:
                get_sharded_checkpoint(state_dict, self, torch.distributed.get_rank(), degree)
                return super().load_state_dict(state_dict, strict=strict, **kw)

        Sharded.__name__ = Sharded.__qualname__ = cls.__name__
        return Sharded

    model.text_model_cls = sharding(model.text_model_cls)
    model.vision_model_cls = sharding(model.vision_model_cls)
    return [
        stand_in(
            "checkpoint sharded (preshard hooks) before loading at TP 1 too",
            "models/llama4/modeling_llama4.py NeuronLlama4ForCausalLM.to_cpu",
        )
    ]


def define_tensor_capture_hook(base_module: Any) -> list[dict[str, str]]:
    """NxDI 0.8's NeuronBaseForImageToText.forward reads `tensor_capture_hook`, neither
    its parameter nor a module global (NameError after the text model ran; host Python,
    so on a device too). Defined as None here so the rest can be measured."""
    if hasattr(base_module, "tensor_capture_hook") or "tensor_capture_hook" in (
        base_module.NeuronBaseForImageToText.forward.__code__.co_varnames
    ):
        return []
    base_module.tensor_capture_hook = None
    return [
        stand_in(
            "module global tensor_capture_hook=None",
            "models/image_to_text_model_base.py NeuronBaseForImageToText.forward",
        )
    ]


def load(plan: dict[str, Any]) -> tuple[Any, dict[str, str], list[dict[str, str]]]:
    """NeuronLlama4ForCausalLM on the CPU: (model, what the shipped to_cpu did, stand-ins)."""
    from neuronx_distributed_inference.models.llama4.modeling_llama4 import (
        NeuronLlama4ForCausalLM,
    )

    free_master_port()
    model = NeuronLlama4ForCausalLM(plan["model"], nxdi_config(plan))
    try:
        model.to_cpu()
        return model, {"ok": "the shipped to_cpu ran"}, run_wrappers_eagerly(model)
    except RuntimeError as exc:  # recorded: the finding for both releases
        shipped = error(exc)
    stand_ins = shard_at_tp_1(model)
    model.to_cpu()
    return model, shipped, stand_ins + run_wrappers_eagerly(model)


def image_inputs(prompt: list[int], image_token: int, pixels: torch.Tensor) -> dict[str, Any]:
    """What NeuronLlama4ForCausalLM.forward takes with an image, as NxDI's own input
    processor makes it (models/llama4/utils/input_processor.py): the chunks' pixels and a
    bool mask [1, len(prompt), 1] of the image tokens the features replace."""
    mask = torch.tensor(prompt) == image_token
    return {"pixel_values": pixels, "vision_mask": mask[None, :, None]}


def image_encoding(plan: dict[str, Any], pixels: torch.Tensor) -> tuple[Any, list[dict]]:
    """NxDI's image-encoding application, NeuronLlama4ForImageEncoding, built as NxDI's
    own test builds it (test_llama4_vision_4layer.py: the vision neuron config as the
    config's) and run through NeuronApplicationBase.to_cpu: its output for `pixels`.
    Its wrapper runs eagerly (the pipeline_execution stand-in). The model parallel state
    of the first application is torn down first, as NeuronLlama4ForCausalLM.to_cpu does."""
    from neuronx_distributed.parallel_layers.parallel_state import (
        destroy_model_parallel,
        model_parallel_is_initialized,
    )
    from neuronx_distributed_inference.models.llama4.modeling_llama4_vision import (
        NeuronLlama4ForImageEncoding,
    )

    config = nxdi_config(plan)
    config.neuron_config = copy.deepcopy(config.vision_config.neuron_config)
    application = NeuronLlama4ForImageEncoding(model_path=plan["model"], config=config)
    if model_parallel_is_initialized():
        destroy_model_parallel()
    application.to_cpu()
    eager = [w.tag for w in application.models if w.pipeline_execution]
    for wrapper in application.models:
        wrapper.pipeline_execution = False
    with torch.no_grad():
        features = application.forward(pixels)
    what = f"pipeline_execution=False on {eager}"
    stand_ins = [stand_in(what, "models/model_wrapper.py ModelWrapper._forward")] if eager else []
    return features, stand_ins


def main(plan: dict[str, Any], out: Path) -> dict[str, Any]:
    from neuronx_distributed_inference.models import image_to_text_model_base as base_module

    model, shipped_to_cpu, stand_ins = load(plan)
    pixels = torch.from_numpy(np.load(plan["pixel_values"], allow_pickle=False))
    runner = Runner(model, base_module, {})
    first = next(iter(plan["cases"].values()))["prompt"]
    try:
        runner.step(first, 0, False, None)
        shipped: dict[str, str] = {"ok": "the shipped forward ran"}
    except NameError as exc:  # recorded: the finding for NxDI 0.8
        shipped = error(exc)
    stand_ins += define_tensor_capture_hook(base_module)
    cases = {}
    for name, case in plan["cases"].items():
        if case.get("image"):
            runner.images = image_inputs(case["prompt"], plan["image_token"], pixels)
        tokens, logits = runner.greedy(case)
        np.save(out / f"{name}.npy", logits.astype(np.float32))
        cases[name] = {"tokens": tokens}
    with torch.no_grad():
        vision = model.vision_encoder_model(pixels)
    np.save(out / "vision.npy", vision.float().numpy())
    encoded, encoder_stand_ins = image_encoding(plan, pixels)
    np.save(out / "image_encoding.npy", encoded.float().numpy())
    return {
        "nxdi": importlib.metadata.version("neuronx-distributed-inference"),
        "stand_ins": stand_ins + encoder_stand_ins,
        "shipped_to_cpu": shipped_to_cpu,
        "shipped_forward": shipped,
        "cases": cases,
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))))
