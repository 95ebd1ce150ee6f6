"""The vision encoder's cost on a backend and the padding of its buckets:

- per vision bucket, the median milliseconds of one image through the vision graph
  (`encode_image`), and of the context encoding that takes its embeddings;
- the host's share of such a multimodal prefill: the plugin's own work (the call's
  arrays, the image rows placed at their placeholders, M-RoPE positions) against the
  backend's;
- the padding the default vision buckets waste on a mix of image sizes, each resized
  as the model's processor resizes it: the Qwen2-VL family's `smart_resize` under a
  max_pixels setting, or Llama 4's fit to a grid of at most 16 tiles of 336 pixels.

    python scripts/bench_vision.py --out bench-results/vision
    python scripts/bench_vision.py --arch llama4 --out bench-results/vision-llama4

The mix is not a trace (no public trace of image sizes ships with the project): one image
of each size in IMAGE_SIZES, resolutions of the devices and sources images come from.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

from neuron_plugin.core.vision import (  # noqa: E402
    ImageInputs,
    VisionGeometry,
    VisionLimits,
    chunk_embeddings,
    llama4_limits,
    mrope_positions,
    resolve_vision_buckets,
    vision_bucket,
)

# (width, height, source): one image of each.
IMAGE_SIZES = [
    (4032, 3024, "phone photo, landscape"),
    (3024, 4032, "phone photo, portrait"),
    (1920, 1080, "desktop screenshot, 1080p"),
    (2560, 1440, "desktop screenshot, 1440p"),
    (1179, 2556, "phone screenshot"),
    (640, 480, "web image, 4:3"),
    (640, 427, "web image, 3:2"),
    (480, 640, "web image, portrait"),
    (1240, 1754, "A4 page scanned at 150 dpi"),
    (256, 256, "thumbnail"),
]
PATCH, MERGE = 14, 2
# Llama 4 Scout's and Maverick's preprocessor_config.json: tiles of 336 pixels, at most
# 16 of them (max_patches) before the global tile.
LLAMA4_TILE, LLAMA4_MAX_TILES = 336, 16


def resized_patches(width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    """Patches of an image after the Qwen2-VL processor's `smart_resize`: each side
    rounded to a multiple of patch x merge, then scaled (keeping the aspect ratio) into
    [min_pixels, max_pixels]."""
    factor = PATCH * MERGE
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // PATCH) * (w // PATCH)


def llama4_grid(width: int, height: int, tile: int, max_tiles: int) -> tuple[int, int, float]:
    """The (rows, columns) of tiles Llama 4's processor fits an image to, and the share of
    that canvas its resized image leaves as padding. transformers' Llama4ImageProcessor
    (find_supported_resolutions, get_best_fit, get_max_res_without_distortion;
    resize_to_max_canvas off): of the grids of at most max_tiles tiles, the one needing
    the least upscaling, else the least downscaling, the smallest on a tie; the image is
    then scaled into it without distortion and never upscaled past one tile a side."""
    grids = [(r, c) for r in range(1, max_tiles + 1) for c in range(1, max_tiles // r + 1)]
    scales = {g: min(g[0] * tile / height, g[1] * tile / width) for g in grids}
    upscales = [s for s in scales.values() if s >= 1]
    chosen = min(upscales) if upscales else max(scales.values())
    rows, columns = min((g for g, s in scales.items() if s == chosen), key=lambda g: g[0] * g[1])
    bound_h = min(max(height, tile), rows * tile)
    bound_w = min(max(width, tile), columns * tile)
    if bound_w / width < bound_h / height:
        resized = bound_w * min(math.floor(height * bound_w / width), bound_h)
    else:
        resized = bound_h * min(math.floor(width * bound_h / height), bound_w)
    return rows, columns, 1 - resized / (rows * columns * tile * tile)


def padding_rows(arch: str, min_pixels: int, max_pixels: int) -> tuple[list[dict[str, Any]], float]:
    """Each image's patches and bucket under the default buckets, and the share of the
    mix's computed patches that are padding (Llama 4: also the share of its tiles'
    pixels that are the processor's own padding, `canvas`)."""
    if arch == "llama4":
        preprocessor = {"max_patches": LLAMA4_MAX_TILES}
        limits = llama4_limits(preprocessor, {}, LLAMA4_TILE, PATCH)
    else:
        limits = VisionLimits(
            min_patches=max(4, math.ceil(min_pixels / PATCH**2) // 4 * 4),
            max_patches=max_pixels // PATCH**2 // 4 * 4,
            step=MERGE * MERGE,
        )
    buckets = resolve_vision_buckets({}, limits)
    rows: list[dict[str, Any]] = []
    for width, height, source in IMAGE_SIZES:
        row: dict[str, Any] = {"image": f"{width}x{height}", "source": source}
        if arch == "llama4":
            grid_rows, columns, canvas = llama4_grid(width, height, LLAMA4_TILE, LLAMA4_MAX_TILES)
            local = grid_rows * columns
            patches = (local + (local > 1)) * limits.step
            row.update(grid=f"{grid_rows}x{columns}", canvas=round(canvas, 4))
        else:
            patches = resized_patches(width, height, min_pixels, max_pixels)
        rows.append({**row, "patches": patches, "bucket": vision_bucket(buckets, patches)})
    computed = sum(r["bucket"] for r in rows)
    return rows, 1 - sum(r["patches"] for r in rows) / computed


def full_image(patches: int, patch_dim: int, tile_side: int | None) -> ImageInputs:
    """An image of exactly `patches` random patches, filling its bucket: a 2 x patches/2
    grid, which a 2 x 2 merge divides, or (Llama 4) whole tiles of tile_side patches a
    side."""
    pixels = np.random.default_rng(0).standard_normal((patches, patch_dim), dtype=np.float32)
    if tile_side is None:
        return ImageInputs(pixels, np.array([1, 2, patches // 2], dtype=np.int64))
    tiles = patches // tile_side**2
    return ImageInputs(pixels, np.array([tiles, tile_side, tile_side], dtype=np.int64))


def median_ms(call: Any, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def encoder_rows(model: Path, repeats: int) -> list[dict[str, Any]]:
    """Per vision bucket of the model's default grid: the image's encoder time, the
    context encoding that takes its embeddings, and the host's share of that prefill
    (with M-RoPE positions for the Qwen2-VL family; Llama 4's are the prompt's own)."""
    import dataclasses

    from neuron_plugin.backends.reference.backend import ReferenceBackend
    from neuron_plugin.core.checkpoint import read_hf_config
    from neuron_plugin.core.inputs import context_encoding_inputs
    from neuron_plugin.core.settings import EngineLimits, resolve_settings
    from neuron_plugin.core.vision import image_limits, read_image_processor_config

    config = read_hf_config(model)
    saved, source = read_image_processor_config(model)
    limits = image_limits(saved, {}, config.get("vision_config") or {}, source)
    tile_side = math.isqrt(limits.step) if limits.global_tile else None  # Llama 4's tiles
    settings = resolve_settings(
        EngineLimits(
            max_model_len=1024,
            max_num_seqs=1,
            block_size=None,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            max_num_batched_tokens=1024,
            dtype="float32",
            vision=limits,
        ),
        {},
        backend="reference",
        architecture=config["architectures"][0],
    )
    backend = ReferenceBackend(settings, model)
    with tempfile.TemporaryDirectory() as folder:
        backend.compile(Path(folder))
        backend.load(Path(folder))
    geometry = VisionGeometry.from_hf_config(config)
    if geometry is None:
        raise SystemExit(f"--model {model}: not a vision-language model (no vision_config)")
    width = geometry.embedding_width  # Qwen3-VL: with its DeepStack levels
    # the token an image's embeddings replace (the Qwen2-VL family's key; Llama 4's)
    image_token = config.get("image_token_id", config.get("image_token_index"))
    if image_token is None:
        raise SystemExit(f"--model {model}: config.json names no image_token_id")
    rows = []
    for bucket in settings.vision_buckets:
        image = full_image(bucket, geometry.patch_dim, tile_side)
        encode_ms = median_ms(lambda image=image: backend.encode_image(image), repeats)
        embeddings = backend.encode_image(image)
        tokens = embeddings.shape[0]
        prompt = np.array([5] * 8 + [int(image_token)] * tokens + [6] * 8, dtype=np.int64)

        def host(prompt=prompt, embeddings=embeddings, image=image):
            inputs = context_encoding_inputs(settings, prompt, 0, 0, None)
            vision, mask = chunk_embeddings(
                0, prompt.size, inputs.input_ids.shape[1], width, [(8, embeddings)]
            )
            inputs = dataclasses.replace(inputs, vision_embeddings=vision, vision_mask=mask)
            if tile_side is not None:
                return inputs
            rope, _ = mrope_positions(prompt.size, [(8, image.grid_thw)], MERGE)
            rotary = np.zeros((3, 1, inputs.input_ids.shape[1]), dtype=np.int64)
            rotary[:, 0, : prompt.size] = rope
            return dataclasses.replace(inputs, rope_positions=rotary)

        host_ms = median_ms(host, repeats)
        inputs = host()
        prefill_ms = median_ms(lambda inputs=inputs: backend.forward(inputs), repeats)
        rows.append(
            {
                "bucket": bucket,
                "tokens": tokens,
                "encode_ms": round(encode_ms, 3),
                "prefill_ms": round(prefill_ms, 3),
                "host_ms": round(host_ms, 3),
                "host_share": round(host_ms / (host_ms + encode_ms + prefill_ms), 4),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch",
        choices=["qwen2_vl", "llama4"],
        default="qwen2_vl",
        help="the processor the image mix is resized by, and the tiny checkpoint timed",
    )
    parser.add_argument("--model", type=Path, help="a checkpoint of --arch (default: the tiny one)")
    parser.add_argument("--min-pixels", type=int, default=256 * 28 * 28, help="Qwen2-VL only")
    parser.add_argument("--max-pixels", type=int, default=1280 * 28 * 28, help="Qwen2-VL only")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "vision")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    model = args.model or build(args.arch, ROOT / "models" / f"tiny-{args.arch}")
    encoder = encoder_rows(model, args.repeats)
    images, waste = padding_rows(args.arch, args.min_pixels, args.max_pixels)
    meta = run_meta("bench_vision.py", argv, model=str(model))
    table = [
        [
            str(r["bucket"]),
            str(r["tokens"]),
            f"{r['encode_ms']:.2f}",
            f"{r['prefill_ms']:.2f}",
            f"{r['host_ms']:.3f}",
            f"{100 * r['host_share']:.3f}%",
        ]
        for r in encoder
    ]
    table += [
        [
            r["image"],
            r["source"],
            str(r["patches"]),
            str(r["bucket"]),
            f"{100 * (1 - r['patches'] / r['bucket']):.1f}%",
            f"{r['grid']} tiles, canvas {100 * r['canvas']:.1f}% padding" if "grid" in r else "",
        ]
        for r in images
    ]
    bound = f"max_pixels {args.max_pixels}"
    if args.arch == "llama4":
        bound = f"max_patches {LLAMA4_MAX_TILES}"
    table.append(["mix", bound, "", "", f"{100 * waste:.1f}%", ""])
    write_results(
        args.out,
        meta,
        {"encoder": encoder, "images": images, "padding_share": waste},
        [
            "bucket / image",
            "tokens / source",
            "encode ms / patches",
            "prefill ms / bucket",
            "host ms / padding",
            "host share / tiles",
        ],
        table,
    )


if __name__ == "__main__":
    main()
