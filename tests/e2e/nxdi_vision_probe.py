"""Run under an interpreter with NxD Inference (its CPU mode): NxDI's own
NeuronQwen2VLForCausalLM on the tiny Qwen2-VL checkpoint, in the cases
test_nxdi_vision.py compares with transformers; prints one JSON object. This is the
evidence behind the nxd backend's refusal of the Qwen2-VL family, so the model runs as
NxDI ships it: its `forward` builds the vision mask and positions, runs the vision
encoder and the text model. The plugin is not involved.

    python nxdi_vision_probe.py PLAN_JSON OUT_DIR

PLAN: {"model": dir, "bucket": context and token-generation bucket, "image_size": [width,
height], "pixel_values": .npy [patches, 1176], "image_grid_thw": [[t, h, w]], "cases":
{name: {"prompt": ids, "steps": decode steps, "image": bool, "mrope": {"positions": [3 x
len(prompt)], "delta": int} or absent}}}. Each case is prefilled, then decoded greedily
for its steps; its greedy tokens go in the report and every step's logits in
OUT_DIR/NAME.npy (float32 [steps + 1, vocab]).

What NxDI's CPU mode cannot run as shipped gets a stand-in here, and only here, each
listed in the report under "stand_ins" with the NxDI file:function it works around:
the wrappers' pipeline execution (a traced model's path), the vision encoder's module
(to_cpu builds the text one only), and on NxDI 0.8 the `tensor_capture_hook` keyword
(after recording, under "shipped_forward", that NxDI's forward raises without it). A case
with "mrope" is the experiment that pins the cause of the image prompts' difference:
transformers' 3-D M-RoPE positions handed to the text model ("experiment" in the report).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

# NxDI's Qwen2VLInferenceConfig.add_special_config copies these from the top level of
# the config (QWEN2_VL_TEXT_CONFIG_KEYS, qwen2_vl/modeling_qwen2_vl.py) and nothing
# in NxDI reads vision_token_id; transformers' Qwen2-VL has no such key.
UNREAD_KEYS = {"vision_token_id": None}


def flat_hf_config(model_dir: str) -> Any:
    """The checkpoint's config with its text_config keys also at the top level, as the
    published Qwen2-VL checkpoints have them: NxDI reads the text model's keys only from
    there (Qwen2VLInferenceConfig.add_special_config; a config with them only under
    text_config, transformers 5's layout, fails with AttributeError 'hidden_size')."""
    from transformers import AutoConfig, PretrainedConfig

    config = AutoConfig.from_pretrained(model_dir).to_dict()
    text = config["text_config"]
    return PretrainedConfig(**{**UNREAD_KEYS, **text, **config})


def single_core(bucket: int) -> dict[str, Any]:
    """The NeuronConfig fields of a float32 CPU-mode application at TP 1, batch 1, whose
    text and vision configs both take them."""
    return {
        "tp_degree": 1,
        "world_size": 1,
        "torch_dtype": torch.float32,
        "on_cpu": True,
        "batch_size": 1,
        "seq_len": bucket,
        "enable_bucketing": True,
    }


def text_neuron_config(neuron_config: Any, bucket: int) -> Any:
    """The text model's NeuronConfig (class `neuron_config`): `bucket` is its one context
    bucket and its token-generation one."""
    return neuron_config(
        **single_core(bucket),
        ctx_batch_size=1,
        tkg_batch_size=1,
        max_context_length=bucket,
        context_encoding_buckets=[bucket],
        token_generation_buckets=[bucket],
    )


def nxdi_config(plan: dict[str, Any]) -> Any:
    """NxDI's Qwen2VLInferenceConfig for one context bucket (also the token-generation
    one, so the CPU module's n_positions, set once by to_cpu, is every call's) and one
    image per vision-encoder call. The vision config must have fused_qkv
    (Qwen2VLInferenceConfig.validate_model_supported_configs asserts it). NxDI 0.8 has
    no Qwen2VLNeuronConfig: its image size is the constant 640x320
    (qwen2_vl/utils/constants.py), which the plan must then match."""
    from neuronx_distributed_inference.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    neuron_config = getattr(qwen2_vl, "Qwen2VLNeuronConfig", qwen2_vl.NeuronConfig)
    common = single_core(plan["bucket"])
    text = text_neuron_config(neuron_config, plan["bucket"])
    size = {}
    if hasattr(qwen2_vl, "Qwen2VLNeuronConfig"):
        width, height = plan["image_size"]
        size = {"default_image_width": width, "default_image_height": height}
    vision = neuron_config(**common, buckets=[1], fused_qkv=True, **size)
    return qwen2_vl.Qwen2VLInferenceConfig(
        text_neuron_config=text,
        vision_neuron_config=vision,
        load_config=load_pretrained_config(hf_config=flat_hf_config(plan["model"])),
    )


def free_master_port() -> None:
    """to_cpu() starts a gloo group on MASTER_PORT (29500 unless set,
    application_base.py to_cpu): a free one keeps parallel runs apart."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(probe.getsockname()[1]))


def stand_in(what: str, works_around: str) -> dict[str, str]:
    return {"what": what, "works_around": works_around}


def run_wrappers_eagerly(model: Any) -> list[dict[str, str]]:
    """Every wrapper of an image-to-text model is built with pipeline_execution=True,
    and ModelWrapper._forward then calls self.model.nxd_model.forward_ranked, which only
    a traced model has (AttributeError 'nxd_model' on the CPU)."""
    eager = [w for w in [*model.text_models, *model.vision_models] if w.pipeline_execution]
    for wrapper in eager:
        wrapper.pipeline_execution = False
    if not eager:
        return []
    return [
        stand_in(
            f"pipeline_execution=False on {[w.tag for w in eager]}",
            "models/model_wrapper.py ModelWrapper._forward",
        )
    ]


def build_vision_module(model: Any) -> list[dict[str, str]]:
    """to_cpu() builds modules for self.models, which NeuronBaseForImageToText sets to
    the text wrappers: the vision encoder keeps model=None ("Forward called before
    load"). Built and loaded here as to_cpu builds the text module; every weight of the
    module must come from the checkpoint (only the rank buffers may be missing)."""
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    wrapper = model.vision_encoder_model
    if wrapper.model is not None:
        return []
    module = wrapper.model_cls(wrapper.config)
    weights = model.checkpoint_loader_fn()
    get_sharded_checkpoint(
        weights, module, torch.distributed.get_rank(), model.vision_config.neuron_config.tp_degree
    )
    missing = [
        k
        for k in module.load_state_dict(weights, strict=False).missing_keys
        if not k.endswith("rank_util.rank")
    ]
    if missing:
        raise RuntimeError(f"vision encoder weights missing from the checkpoint: {missing}")
    wrapper.model = module.eval()
    return [
        stand_in(
            "vision encoder module built and loaded as to_cpu loads the text one",
            "models/application_base.py NeuronApplicationBase.to_cpu",
        )
    ]


def accept_tensor_capture_hook(base_module: Any) -> list[dict[str, str]]:
    """NxDI 0.8's NeuronQwen2VLForCausalLM.forward passes tensor_capture_hook= to
    NeuronBaseForImageToText.forward, which has no such parameter and whose body reads
    the name anyway. Host Python, not CPU-specific: the shipped forward cannot answer
    any request (recorded as "shipped_forward" before this runs). The keyword is
    accepted and dropped, the name defined as None, so the rest can be measured."""
    base = base_module.NeuronBaseForImageToText
    shipped = base.forward
    if "tensor_capture_hook" in inspect.signature(shipped).parameters:
        return []

    def forward(self: Any, *args: Any, tensor_capture_hook: Any = None, **kwargs: Any) -> Any:
        return shipped(self, *args, **kwargs)

    base_module.tensor_capture_hook = None
    base.forward = forward
    return [
        stand_in(
            "tensor_capture_hook accepted and dropped, module global tensor_capture_hook=None",
            "models/image_to_text_model_base.py NeuronBaseForImageToText.forward "
            "(called by qwen2_vl/modeling_qwen2_vl.py NeuronQwen2VLForCausalLM.forward)",
        )
    ]


def rotary_embedding_takes_3d_positions(text_module: Any) -> str:
    """The experiment's one change to NxDI's math: NeuronQwen2VLRotaryEmbedding.forward
    broadcasts 2-D position_ids to M-RoPE's three sections (t, h, w); given 3-D ones
    [3, batch, seq] (transformers' get_rope_index), section i takes its angles from
    positions[i], computed by NxDI's own forward. 2-D positions behave as shipped."""
    embedding = text_module.NeuronQwen2VLRotaryEmbedding
    shipped = embedding.forward

    def forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        if position_ids.dim() == 2:
            return shipped(self, x, position_ids)
        per_section = [shipped(self, x, position_ids[i]) for i in range(3)]
        return tuple(
            torch.stack([pair[k][i] for i, pair in enumerate(per_section)]) for k in (0, 1)
        )

    embedding.forward = forward
    return (
        "qwen2_vl/modeling_qwen2_vl_text.py NeuronQwen2VLRotaryEmbedding.forward takes "
        "[3, batch, seq] positions (section i from positions[i]); "
        "models/image_to_text_model_base.py NeuronBaseForImageToText.forward gets them "
        "as rotary_position_ids (NeuronQwen2VLForCausalLM.forward has no such argument)"
    )


@contextmanager
def rotary_position_ids(base_module: Any, positions: torch.Tensor | None) -> Iterator[None]:
    """During one call of NxDI's NeuronQwen2VLForCausalLM.forward, its call of
    NeuronBaseForImageToText.forward also gets `positions` as rotary_position_ids."""
    if positions is None:
        yield
        return
    base = base_module.NeuronBaseForImageToText
    shipped = base.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return shipped(self, *args, rotary_position_ids=positions, **kwargs)

    base.forward = forward
    try:
        yield
    finally:
        base.forward = shipped


def error(exc: BaseException) -> dict[str, str]:
    return {"error": type(exc).__name__, "message": str(exc)[:600]}


class Runner:
    """Greedy requests through an NxDI image-to-text model's forward (Qwen2-VL's;
    Llama 4's in nxdi_llama4_probe.py), batch 1."""

    def __init__(self, model: Any, base_module: Any, images: dict[str, torch.Tensor]):
        from neuronx_distributed_inference.modules.generation.sampling import (
            prepare_sampling_params,
        )

        self.model, self.base_module, self.images = model, base_module, images
        # always passed: ModelWrapper.forward drops non-tensor positional args, so a
        # None would shift every later input by one slot
        self.sampling = prepare_sampling_params(1)

    def step(
        self, ids: list[int], start: int, image: bool, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """One call (a prefill from position 0, or one decode step): the last logits.
        The attention mask covers the prompt in a prefill, the tokens already in the KV
        cache in a decode step (as NxDI's HuggingFaceGenerationAdapter passes it)."""
        end = start + len(ids)
        known = start if start else len(ids)
        with rotary_position_ids(self.base_module, positions), torch.no_grad():
            out = self.model.forward(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones((1, known), dtype=torch.int64),
                position_ids=torch.arange(start, end)[None],
                seq_ids=torch.tensor([0]),
                sampling_params=self.sampling,
                **(self.images if image else {}),
            )
        logits = out.logits
        return (logits[0, -1] if logits.dim() == 3 else logits[0]).float()

    def greedy(self, case: dict[str, Any]) -> tuple[list[int], np.ndarray]:
        prompt, mrope = case["prompt"], case.get("mrope")
        positions = None if mrope is None else torch.tensor(mrope["positions"])[:, None, :]
        rows = [self.step(prompt, 0, case.get("image", False), positions)]
        tokens = [int(rows[-1].argmax())]
        for position in range(len(prompt), len(prompt) + case["steps"]):
            at = None if mrope is None else torch.tensor([[position + mrope["delta"]]])
            rows.append(self.step([tokens[-1]], position, False, at))
            tokens.append(int(rows[-1].argmax()))
        return tokens, torch.stack(rows).numpy()


def load(plan: dict[str, Any]) -> tuple[Any, list[dict[str, str]]]:
    """NeuronQwen2VLForCausalLM on the CPU with the CPU-mode stand-ins."""
    from neuronx_distributed_inference.models.qwen2_vl.modeling_qwen2_vl import (
        NeuronQwen2VLForCausalLM,
    )

    model = NeuronQwen2VLForCausalLM(plan["model"], nxdi_config(plan))
    patches = int(np.prod(plan["image_grid_thw"][0]))
    if model.vision_encoder_model.pixels_per_image != patches:
        raise ValueError(
            f"this NxDI takes {model.vision_encoder_model.pixels_per_image} "
            f"patches per image, the plan's image has {patches}"
        )
    free_master_port()
    model.to_cpu()
    return model, run_wrappers_eagerly(model) + build_vision_module(model)


def main(plan: dict[str, Any], out: Path) -> dict[str, Any]:
    from neuronx_distributed_inference.models import image_to_text_model_base as base_module
    from neuronx_distributed_inference.models.qwen2_vl import modeling_qwen2_vl_text

    model, stand_ins = load(plan)
    images = {
        "pixel_values": torch.from_numpy(np.load(plan["pixel_values"], allow_pickle=False)),
        "image_grid_thw": torch.tensor(plan["image_grid_thw"]),
    }
    runner = Runner(model, base_module, images)
    first = next(iter(plan["cases"].values()))["prompt"]
    try:
        runner.step(first, 0, False, None)
        shipped: dict[str, str] = {"ok": "the shipped forward ran"}
    except Exception as exc:  # recorded: the finding for NxDI 0.8
        shipped = error(exc)
    stand_ins += accept_tensor_capture_hook(base_module)
    experiment = None
    cases = {}
    for name, case in plan["cases"].items():
        if case.get("mrope") and experiment is None:
            experiment = rotary_embedding_takes_3d_positions(modeling_qwen2_vl_text)
        tokens, logits = runner.greedy(case)
        np.save(out / f"{name}.npy", logits.astype(np.float32))
        cases[name] = {"tokens": tokens}
    return {
        "nxdi": importlib.metadata.version("neuronx-distributed-inference"),
        "stand_ins": stand_ins,
        "shipped_forward": shipped,
        "experiment": experiment,
        "cases": cases,
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))))
