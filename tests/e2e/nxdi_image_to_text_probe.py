"""Run under an interpreter with NxD Inference (its CPU mode): a vision-language tiny
checkpoint (Qwen3-VL's, Qwen2-VL's, Qwen2.5-VL's, Pixtral's, Llama 4's)
through the plugin's NxDBackend and its host-side image path (serving.images.Images:
encoder runs through NxDBackend.encode_image, placeholders, M-RoPE positions, decode
deltas), in the cases the image-to-text tests compare with transformers (tests/e2e
/nxdi_image_to_text.py); prints one JSON object.

    python nxdi_image_to_text_probe.py PLAN_JSON OUT_DIR

PLAN: {"model": dir, "settings": SETTINGS, "steps": N, "cases": {name: [row, ...]},
"images": {name: {"grid": [t, h, w], "pixels": npy}} (optional)}, a row {"prompt": [...],
"images": [{"offset": o, "grid": [t, h, w], "pixels": npy}]} (a Pixtral or Llama 4
image: "is_embed" [...] instead of "grid", pixels [C, H, W] or its tiles)
(settings resolved by the test: this side has no vLLM). Each case prefills its rows one
by one (row i in sequence slot i), then decodes them together N steps with logits
(`forward`; a case named *device_sampling: NxDI's greedy on-device sampler, `run`). The
report: {case: tokens per row, "padding": the answer's shape of a padding call per vision
bucket}; OUT_DIR/CASE.npy holds the logits (float32 [rows, N + 1,
vocab]; a device-sampling case: its tokens), OUT_DIR/embeddings-NAME.npy each plan
image's embeddings from NxDBackend.encode_image. A refusal gives {"refused": message}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.vision import ImageInputs, padding_image
from neuron_plugin.serving.images import Images


def feature(name: str, image: dict[str, Any], merge: int) -> SimpleNamespace:
    """One image as vLLM's multimodal feature carries it (the fields serving.images
    reads): the Qwen-VL processors' patches and grid, or a Pixtral image [C, H, W] with
    its placeholders' is_embed (an image without a grid)."""
    pixels = torch.from_numpy(np.load(image["pixels"]))
    if "grid" not in image:
        embed = torch.tensor(image["is_embed"], dtype=torch.bool)
        return SimpleNamespace(
            modality="image",
            identifier=name,
            mm_position=SimpleNamespace(offset=image["offset"], length=len(embed), is_embed=embed),
            data={"pixel_values": SimpleNamespace(data=pixels)},
        )
    grid = np.asarray(image["grid"], dtype=np.int64)
    tokens = int(np.prod(grid)) // (merge * merge)
    return SimpleNamespace(
        modality="image",
        identifier=name,
        mm_position=SimpleNamespace(offset=image["offset"], length=tokens, is_embed=None),
        data={
            "pixel_values": SimpleNamespace(data=pixels),
            "image_grid_thw": SimpleNamespace(data=torch.from_numpy(grid)),
        },
    )


def greedy(rows: int) -> SamplingInputs:
    return SamplingInputs(
        top_k=np.ones(rows, dtype=np.int32),
        top_p=np.ones(rows, dtype=np.float32),
        temperature=np.ones(rows, dtype=np.float32),
        uniform=np.zeros((rows, 1), dtype=np.float32),
        needs_logits=np.zeros(rows, dtype=bool),
    )


def step(backend: NxDBackend, inputs: Any, rows: int, device: bool) -> np.ndarray:
    """Each row's logits (`forward`), or its token from NxDI's on-device sampler (`run`,
    greedy) as [rows, 1]."""
    if device:
        return backend.run(inputs, greedy(rows)).tokens[:, :1].astype(np.float32)
    return backend.forward(inputs).numpy()


def run_case(
    backend: NxDBackend, images: Images, name: str, rows: list[dict], steps: int, merge: int
) -> tuple[list[list[int]], np.ndarray]:
    """The case's rows prefilled one by one and decoded together; a case whose name ends
    in `device_sampling` samples on the device (its logits: the tokens)."""
    device = name.endswith("device_sampling")
    settings = backend.settings
    req_ids = [f"{name}-{slot}" for slot in range(len(rows))]
    tokens: list[list[int]] = []
    logits: list[list[np.ndarray]] = []
    for slot, (req_id, row) in enumerate(zip(req_ids, rows, strict=True)):
        features = [feature(f"{req_id}-{i}", im, merge) for i, im in enumerate(row["images"])]
        images.add(req_id, len(row["prompt"]), features)
        images.encode([], {req_id: list(range(len(features)))})
        inputs = context_encoding_inputs(settings, np.array(row["prompt"]), 0, slot, None)
        out = step(backend, images.context(req_id, inputs), 1, device)[0]
        tokens.append([int(out[0]) if device else int(out.argmax())])
        logits.append([out])
    for _ in range(steps):
        positions = np.array(
            [len(r["prompt"]) + len(t) - 1 for r, t in zip(rows, tokens, strict=True)]
        )
        inputs = token_generation_inputs(
            settings,
            np.array([t[-1] for t in tokens]),
            positions,
            np.arange(len(rows)),
            None,
            logits=not device,
        )
        out = step(backend, images.decode(req_ids, inputs), len(rows), device)
        for row in range(len(rows)):
            tokens[row].append(int(out[row][0]) if device else int(out[row].argmax()))
            logits[row].append(out[row])
    for req_id in req_ids:
        images.remove(req_id)
    return tokens, np.array(logits, dtype=np.float32)


def main(plan: dict[str, Any], out: Path) -> dict[str, Any]:
    settings = NeuronSettings.from_dict(plan["settings"])
    try:
        backend = NxDBackend(settings, plan["model"])
    except NeuronConfigError as exc:
        return {"refused": str(exc)}
    folder = out / "graphs"
    folder.mkdir()
    backend.compile(folder)
    backend.load(folder)
    hf_config = read_hf_config(plan["model"])
    merge = int(hf_config["vision_config"].get("spatial_merge_size", 1))
    images = Images(backend, hf_config)
    report: dict[str, Any] = {
        "patches": backend.nxdi.patches,
        "status": dict(backend.nxdi.patch_status),
        # a padding call of each vision bucket (warm-up): the shape of its answer
        "padding": {
            bucket: list(backend.encode_image(padding_image(bucket)).shape)
            for bucket in settings.vision_buckets
        },
    }
    for name, image in plan.get("images", {}).items():
        inputs = ImageInputs(np.load(image["pixels"]), np.asarray(image["grid"], dtype=np.int64))
        np.save(out / f"embeddings-{name}.npy", backend.encode_image(inputs))
    for name, rows in plan["cases"].items():
        tokens, logits = run_case(backend, images, name, rows, plan["steps"], merge)
        np.save(out / f"{name}.npy", logits)
        report[name] = tokens
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))))
