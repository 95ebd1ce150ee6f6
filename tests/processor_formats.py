"""The layouts a Qwen2-VL checkpoint's image processor settings come in, each written as
the tool that writes it writes it, with the tiny checkpoints' pixel limits (16 to 256
patches of 14 pixels). tests/plugin/test_vision.py reads them with the plugin;
tests/e2e/test_vision_processor_formats.py puts each beside a tiny Qwen2-VL and compares
the plugin's limits with what vLLM's processor makes of the extreme images."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from neuron_plugin.core.vision import PREPROCESSOR_FILE, PROCESSOR_FILE

SMALL = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}
COMMON = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def write(folder: Path, name: str, settings: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(settings, indent=2))


def hub(folder: Path) -> None:
    """The Hub's Qwen2-VL preprocessor_config.json: min_pixels / max_pixels, no size."""
    pixels = {"min_pixels": SMALL["shortest_edge"], "max_pixels": SMALL["longest_edge"]}
    write(folder, PREPROCESSOR_FILE, {**COMMON, **pixels, "processor_class": "Qwen2VLProcessor"})


def image_processor_saved(folder: Path) -> None:
    """transformers 5's image processor saved on its own (its save_pretrained): a flat
    preprocessor_config.json with size and no min_pixels / max_pixels (Qwen3-VL's Hub
    layout too)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(size=dict(SMALL)).save_pretrained(folder)


def fast_nulls(folder: Path) -> None:
    """transformers 4.57's Qwen2VLImageProcessorFast saved: its to_dict keeps the
    attributes it holds as None, so min_pixels and max_pixels are null beside size
    (written from those keys: the class needs torchvision, which no environment with
    transformers 4.57 here has)."""
    nulls = dict.fromkeys(["min_pixels", "max_pixels", "crop_size", "data_format", "device"])
    write(folder, PREPROCESSOR_FILE, {**COMMON, **nulls, "size": SMALL})


def processor_saved(folder: Path) -> None:
    """transformers 5's processor saved (ProcessorMixin.save_pretrained): the image and
    video processors' settings nested in processor_config.json, no
    preprocessor_config.json (the tiny checkpoint qwen2_vl_tf5's layout, whose file
    test_vision_processor_formats.py checks against transformers 5's own save)."""
    from tiny_models.vision import transformers5_processor_config

    pixels = {"min_pixels": SMALL["shortest_edge"], "max_pixels": SMALL["longest_edge"]}
    saved = transformers5_processor_config(
        {**COMMON, **pixels, "processor_class": "Qwen2VLProcessor"}
    )
    write(folder, PROCESSOR_FILE, saved)


SAVE_4_57 = """
import sys
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
Qwen2VLImageProcessor(min_pixels=int(sys.argv[2]), max_pixels=int(sys.argv[3])).save_pretrained(
    sys.argv[1]
)
"""


def transformers_4_57(folder: Path, sdk_python: str) -> None:
    """transformers 4.57's Qwen2VLImageProcessor saved by transformers 4.57 itself (the
    SDK environment's): preprocessor_config.json with min_pixels, max_pixels and size."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sdk_python, "-c", SAVE_4_57, str(folder), *(str(SMALL[k]) for k in SMALL)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=with_pillow(sdk_python, folder.parent / "pillow"),
    )
    assert done.returncode == 0, done.stderr[-3000:]


def with_pillow(python: str, shim: Path) -> dict[str, str]:
    """An environment in which `python` imports PIL, which transformers' image
    processors need: its own, or where it has none (the SDK environment: NxDI does not
    need Pillow) this interpreter's, on PYTHONPATH (the same CPython release, or a
    skip)."""
    env = dict(os.environ)
    probe = "import sys; print(sys.version_info[:2]); import PIL"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    if found.returncode == 0:
        return env
    if found.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip(f"{python} has no Pillow, and this interpreter's is for another CPython")
    import PIL

    package = Path(PIL.__file__).parent
    shim.mkdir(parents=True, exist_ok=True)
    for source in (package, *package.parent.glob("pillow-*.dist-info")):
        target = shim / source.name
        if not target.exists():
            target.symlink_to(source)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    return env


# layout -> its writer (transformers 4.57's takes the SDK environment's interpreter)
FORMATS: dict[str, Callable[..., None]] = {
    "hub-min-max-pixels": hub,
    "transformers5-image-processor-size": image_processor_saved,
    "transformers4.57-fast-nulls": fast_nulls,
    "transformers5-processor-config": processor_saved,
    "transformers4.57-saved": transformers_4_57,
}
NEEDS_SDK = {"transformers4.57-saved"}
# --mm-processor-kwargs, each over every layout, and the patch range it gives there
OVERRIDES = [
    ({}, (16, 256)),
    ({"max_pixels": 28 * 28 * 16}, (16, 64)),
    ({"min_pixels": 56 * 56 * 2}, (32, 256)),
    ({"size": {"shortest_edge": 56 * 56 * 2, "longest_edge": 28 * 28 * 16}}, (32, 64)),
    ({"images_kwargs": {"max_pixels": 28 * 28 * 16}}, (16, 64)),
    ({"max_pixels": 28 * 28 * 16, "images_kwargs": {"max_pixels": 28 * 28 * 32}}, (16, 128)),
]
