"""What the image-to-text tests on real NxDI share (test_nxdi_qwen_vl.py,
test_nxdi_pixtral.py, test_nxdi_llama4_served.py): the backend's settings, one run of
nxdi_image_to_text_probe.py per release over a model's cases, transformers' greedy
answer, and the comparison of the two. Each case is a list of rows (prompt and images);
its rows prefill one by one and decode together STEPS steps; a case whose name ends in
device_sampling uses NxDI's on-device sampler (tokens only)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

STEPS = 6  # decode steps after the prefill's token
MAX_MODEL_LEN = 256
FULL_BUCKET = 128  # the first context-encoding bucket: the full-bucket case fills it
BUCKETS = {
    "context_encoding_buckets": [FULL_BUCKET, MAX_MODEL_LEN],
    "token_generation_buckets": [MAX_MODEL_LEN],
    "max_batch_buckets": 1,
}
CASES = ["text_only", "one_image", "two_images", "full_bucket", "batch2", "batch2_device_sampling"]
# Logits of NxDI's float32 CPU mode against transformers' (measured up to ~5e-5).
TOLERANCE = 1e-4
PROBE = Path(__file__).with_name("nxdi_image_to_text_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def nxd_settings(
    architecture: str, vision: tuple[int, int, int], vision_buckets: list[int]
) -> dict:
    """The nxd backend's settings in the CPU mode (`vision`: the processor's patch range,
    min, max, step), resolved as the platform resolves them."""
    from neuron_plugin.core.settings import EngineLimits, resolve_settings
    from neuron_plugin.core.vision import VisionLimits

    limits = EngineLimits(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        block_size=None,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=MAX_MODEL_LEN,
        dtype="float32",
        tp_degree=1,
        vision=VisionLimits(*vision),
    )
    override = {"on_cpu": True, **BUCKETS, "vision_buckets": vision_buckets}
    return resolve_settings(limits, override, backend="nxd", architecture=architecture).to_dict()


def run_probe(
    nxdi_python: str,
    model_dir: Path,
    settings: dict,
    cases: dict,
    out: Path,
    images: dict | None = None,
) -> tuple[dict[str, Any], Path]:
    """The probe's report (and its folder: the logits per case, the embeddings of each
    of `images` encoded alone) for `cases`."""
    plan = {
        "model": str(model_dir),
        "steps": STEPS,
        "settings": settings,
        "cases": cases,
        "images": images or {},
    }
    (out / "plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        "NXD_CPU_MODE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [nxdi_python, str(PROBE), str(out / "plan.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), out


def greedy(hf_model: Any, prompt: list[int], **images: Any) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's logits [STEPS + 1, vocab]."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            **images,
            max_new_tokens=STEPS + 1,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack([s[0] for s in out.logits])


def assert_equal_to_transformers(
    probed: tuple[dict[str, Any], Path],
    rows: list[dict],
    case: str,
    expected: Callable[[dict], tuple[list[int], torch.Tensor]],
) -> None:
    """The case's tokens per row equal `expected`'s, and so do its logits within
    TOLERANCE (a device-sampling case: tokens only)."""
    report, out = probed
    assert "refused" not in report, report.get("refused")
    logits = np.load(out / f"{case}.npy", allow_pickle=False)
    for index, row in enumerate(rows):
        tokens, want = expected(row)
        assert report[case][index] == tokens, f"{case} row {index}"
        if case.endswith("device_sampling"):
            continue
        gap = float((torch.from_numpy(logits[index]) - want).abs().max())
        assert gap < TOLERANCE, f"{case} row {index}: logits off by {gap}"


# (image name, where its tokens start) -> (its tokens, its plan entry: offset, pixels, ...)
Placed = Callable[[str, int], tuple[list[int], dict]]


def build_cases(model_dir: Path, placed: Placed) -> dict[str, list[dict]]:
    """Every case's rows ({"prompt", "images"}), images "small" (one that fills the
    first vision bucket) and "wide" (one padded into a larger one) placed by the
    model's `placed`: text only, one image, two, a prompt with an image filling the
    first context bucket exactly, and two rows (one with an image) decoding together."""
    from tests.e2e.support import corpus_token_ids

    def row(parts: list) -> dict:
        prompt: list[int] = []
        images = []
        for part in parts:
            if isinstance(part, str):
                tokens, entry = placed(part, len(prompt))
                images.append(entry)
                prompt += tokens
            else:
                prompt += part
        return {"prompt": prompt, "images": images}

    text = corpus_token_ids(model_dir, 20, offset=11)
    before = corpus_token_ids(model_dir, 30, offset=40)
    after = corpus_token_ids(model_dir, 12, offset=200)
    tail = FULL_BUCKET - len(before) - len(placed("small", 0)[0])
    full = row([before, "small", corpus_token_ids(model_dir, tail, offset=300)])
    assert len(full["prompt"]) == FULL_BUCKET
    return {
        "text_only": [row([text])],
        "one_image": [row([before, "small", after])],
        "two_images": [row([before, "small", after, "wide", text[:5]])],
        "full_bucket": [full],
        "batch2": [row([before, "small", after]), row([text])],
        "batch2_device_sampling": [row([before, "small", after]), row([text])],
    }
