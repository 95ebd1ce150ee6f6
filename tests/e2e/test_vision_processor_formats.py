"""The image limits the plugin plans vision buckets from are the ones vLLM's processor
applies, whatever layout a checkpoint's processor files come in: each layout of
tests/processor_formats.py beside the tiny Qwen2-VL (the Hub's min_pixels / max_pixels,
transformers 5's image processor save (size only) and processor save
(processor_config.json), transformers 4.57's save and its fast processor's nulls), the
tiny qwen2_vl_tf5 and Qwen3-VL checkpoints, each under every kind of
--mm-processor-kwargs, compared with what vLLM's Qwen2-VL processor makes of the largest
image it plans for and of the smallest, in a Neuron host's vLLM environment
(tests/e2e/vision_limits_oracle.py: the model's processor needs torchvision). And the
tiny qwen2_vl_tf5 checkpoint's processor files are what transformers 5 saves."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from neuron_plugin.core.vision import PREPROCESSOR_FILE
from tests.processor_formats import COMMON, FORMATS, NEEDS_SDK, OVERRIDES, write

pytestmark = [pytest.mark.deployment]

ORACLE = Path(__file__).with_name("vision_limits_oracle.py")
# the tiny Qwen2-VL's files each layout sits beside (its processor files replaced)
BESIDE = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.json")
CHECKPOINTS = ("qwen2_vl_tf5", "qwen3_vl")
# Qwen3-VL's 16-pixel patches with min_pixels / max_pixels (vLLM completes a partial
# size in its call from these, which it does not for Qwen2-VL)
QWEN3_PIXELS = "qwen3_vl-min-max-pixels"
# the overrides, and settings vLLM's processor refuses (a partial size replaces the
# default whole) or resolves against the class's defaults (a null replacing a saved key)
KWARGS = [
    *(kwargs for kwargs, _ in OVERRIDES),
    {"size": {"longest_edge": 28 * 28 * 16}},
    {"images_kwargs": {"max_pixels": None}},
]
CASES = [
    (layout, kwargs) for layout in [*FORMATS, *CHECKPOINTS, QWEN3_PIXELS] for kwargs in KWARGS
]


@pytest.fixture(scope="module")
def layouts(tiny_model, sdk_python, tmp_path_factory) -> dict[str, Path]:
    base = tiny_model("qwen2_vl")
    root = tmp_path_factory.mktemp("layouts")
    folders = {}
    for name, writer in FORMATS.items():
        folder = root / name
        folder.mkdir()
        for file in BESIDE:
            (folder / file).symlink_to(base / file)
        if name in NEEDS_SDK:
            writer(folder, sdk_python)
        else:
            writer(folder)
        folders[name] = folder
    qwen3 = tiny_model("qwen3_vl")
    folders[QWEN3_PIXELS] = root / QWEN3_PIXELS
    for file in BESIDE:
        (folders[QWEN3_PIXELS] / file).parent.mkdir(exist_ok=True)
        (folders[QWEN3_PIXELS] / file).symlink_to(qwen3 / file)
    pixels = {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 64, "patch_size": 16}
    write(folders[QWEN3_PIXELS], PREPROCESSOR_FILE,
          {**COMMON, **pixels, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
           "processor_class": "Qwen3VLProcessor"})
    return {**folders, **{name: tiny_model(name) for name in CHECKPOINTS}}


@pytest.fixture(scope="module")
def answers(layouts, host_python) -> dict[str, dict]:
    job = {"cases": [{"model": str(layouts[layout]), "kwargs": kw} for layout, kw in CASES]}
    done = subprocess.run(
        [host_python, str(ORACLE)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(result.removeprefix("RESULT "))
    return {_case_id(case): answer for case, answer in zip(CASES, found, strict=True)}


def _case_id(case) -> str:
    layout, kwargs = case
    return f"{layout}-{json.dumps(kwargs)}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_plugins_limits_are_what_vllms_processor_makes(answers, case):
    """The largest image vLLM plans for has the plugin's max_patches, in the HF
    processor's output and behind vLLM's placeholders alike, and an 8 x 8 image, scaled
    up to at least min_pixels, no fewer than the plugin's min_patches; settings on which
    vLLM's processor fails every image are refused at start-up instead, naming the
    setting."""
    answer = answers[_case_id(case)]
    plugin, processor = answer["plugin"], answer["processor"]
    if "error" in processor:
        assert "error" in plugin, answer
        assert "--mm-processor-kwargs" in plugin["error"], answer
        return
    assert "error" not in plugin, answer
    low, high, _ = plugin
    assert processor["largest"] == processor["largest_placeholders"] == high, answer
    assert processor["smallest"] == processor["smallest_placeholders"], answer
    assert low <= processor["smallest"] <= high, answer


SAVE = """
import sys
from transformers import AutoProcessor
AutoProcessor.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
"""


@pytest.mark.parametrize("source", ["qwen2_vl", "qwen2_vl_tf5"])
def test_the_tf5_checkpoint_holds_what_transformers_5_saves(tiny_model, host_python, tmp_path,
                                                           source):
    """transformers 5's save_pretrained of the tiny Qwen2-VL's processor (loaded from the
    Hub's layout, or from qwen2_vl_tf5's own files) writes qwen2_vl_tf5's
    processor_config.json and chat_template.jinja byte for byte, and no
    preprocessor_config.json."""
    recipe = tiny_model("qwen2_vl_tf5")
    saved = tmp_path / "saved"
    done = subprocess.run(
        [host_python, "-c", SAVE, str(tiny_model(source)), str(saved)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("processor_config.json", "chat_template.jinja"):
        assert (saved / name).read_bytes() == (recipe / name).read_bytes(), name
    assert not (saved / "preprocessor_config.json").exists()
    assert not (recipe / "preprocessor_config.json").exists()
