"""Build small, deterministic checkpoints of the mapped architectures for tests and the demo.

No model can be downloaded on the machines this project is built on, so the tests, the
demo and the benchmarks use checkpoints made here: random weights from a fixed seed and a
byte-level BPE tokenizer trained on `scripts/corpus/tiny_corpus.txt`. The output is a
normal Hugging Face folder (config.json, model.safetensors, tokenizer files) that both
`transformers` and vLLM load, with a chat template in tokenizer_config.json (as Hugging
Face chat checkpoints ship one) so `/v1/chat/completions` works without
`--chat-template`. Re-running with the same arguments leaves an existing folder
untouched (a stamp file records the recipe).

    python scripts/build_tiny_model.py --arch llama --out models/tiny-llama

With `--train-steps N` the weights are trained on the corpus until they memorise it
(`train_on_corpus`): the speculative-decoding tests and benchmark use such a target and a
one-layer draft trained the same way (`build_speculation_models`), so that
drafts get accepted as they do on real text (random weights accept almost none).

The other architectures the nxd backend maps (mistral, qwen2, mixtral, qwen3_moe, gemma3,
gpt_oss, dbrx) are tiny too: 16-token sliding windows, 4 experts top-2, and the
parameters transformers initialises to constants (norms, biases, sinks) randomised. They
are saved with save_pretrained (the Hub's tensor names, e.g. per-expert MoE weights) and
a config.json that transformers 4.57 and 5.x read alike (tests/e2e/test_architectures.py).
gpt-oss is written as openai ships it: its experts in MXFP4 (`*_blocks` / `*_scales`,
`quantization_config` quant_method mxfp4; neuron_plugin.core.mxfp4),
`initial_context_length`, and a 128-token window (NxDI sizes the window cache in
multiples of 128); gpt_oss_float is one with float experts and a 16-token window. The
variants mistral_wide, mistral_small, qwen3_moe_hub and gemma3_nxdi are shapes the
real-NxDI checks need (scripts/tiny_models/text.py).

Vision-language checkpoints (qwen2_vl, qwen2_5_vl, qwen3_vl) carry their processor too: the tiny
tokenizer with Qwen2-VL's vision special tokens, a chat template that renders image
parts as Qwen2-VL's placeholder run, and preprocessor_config.json / chat_template.json
as the Hub's Qwen2-VL ships them, with pixel limits that keep images tiny (16 to 256
patches):

    python scripts/build_tiny_model.py --arch qwen2_vl --out models/tiny-qwen2_vl

qwen2_vl_tf5 is the same Qwen2-VL with its processor saved as transformers 5 saves one
(processor_config.json with the image processor's `size`, chat_template.jinja, no
preprocessor_config.json).
pixtral is Pixtral in transformers' Llava format (as mistral-community/pixtral-12b) with
a PixtralProcessor's files: images up to 128 pixels a side (8 x 8 patches of 16).
llama4 is Llama4ForConditionalGeneration with every text feature at test lengths (NoPE
and RoPE layers, chunked attention over 16 tokens, temperature tuning, dense and MoE
layers; see LLAMA4) and a Llama4Processor's files: 56-pixel tiles, at most 4 an image.

A Qwen3-shaped checkpoint with Qwen3's real vocabulary (151,936 embedding rows; the
tokenizer stays the tiny one, as Qwen3's own 151,669-token tokenizer also leaves padding
rows) and one layer, for measurements where the vocabulary's size matters (sampling,
logits traffic):

    python scripts/build_tiny_model.py --arch qwen3 --layers 1 --model-vocab 151936 \
        --out models/qwen3-vocab151936
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

from neuron_plugin.models.table import ROWS
from tiny_models.common import CHAT_TEMPLATE, CORPUS
from tiny_models.text import write_text
from tiny_models.vision import OWN_WRITERS, VISION_LANGUAGE, write_vlm

__all__ = [
    "CHAT_TEMPLATE",
    "CORPUS",
    "QWEN3_VOCAB",
    "build",
    "build_speculation_models",
    "building",
]

RECIPE_VERSION = 2  # 2: the tokenizer config carries CHAT_TEMPLATE
# Per-architecture recipe changes (absent: none, so other folders stay valid): gpt-oss 1,
# as openai ships it (MXFP4 experts, initial_context_length, a 128-token window).
REVISIONS = {"gpt_oss": 1}
QWEN3_VOCAB = 151_936  # Qwen3's embedding rows
# Every checkpoint the architecture table names (neuron_plugin/models/table.py ModelRow.tiny)
RECIPES = tuple(name for row in ROWS for name in row.tiny)


def recipe(
    arch: str,
    seed: int,
    vocab_size: int,
    max_positions: int,
    layers: int | None = None,
    model_vocab: int | None = None,
    train_steps: int = 0,
) -> dict:
    corpus_digest = __import__("hashlib").sha256(CORPUS.read_bytes()).hexdigest()
    shape = {
        k: v
        for k, v in (("layers", layers), ("model_vocab", model_vocab), ("train_steps", train_steps))
        if v
    }  # absent by default, so existing folders stay valid
    if arch in REVISIONS:
        shape["revision"] = REVISIONS[arch]
    return {
        "recipe_version": RECIPE_VERSION,
        "arch": arch,
        "seed": seed,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "corpus_sha256": corpus_digest,
        **shape,
    }


def build(
    arch: str,
    out: Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    max_positions: int = 4096,
    layers: int | None = None,
    model_vocab: int | None = None,
    train_steps: int = 0,
) -> Path:
    """Write the checkpoint to `out` unless an identical one is already there.
    `vocab_size` sizes the trained tokenizer; `model_vocab` (default: the tokenizer's
    size) the embedding and output rows; `layers` overrides the architecture's depth;
    `train_steps` trains the weights on the corpus (see `train_on_corpus`)."""
    if arch not in RECIPES:
        raise ValueError(f"--arch {arch!r} is not known; choose one of {sorted(RECIPES)}")
    wanted = recipe(arch, seed, vocab_size, max_positions, layers, model_vocab, train_steps)
    with building(out, "tiny_model_recipe.json", wanted) as stale:
        if stale and arch in VISION_LANGUAGE:
            write_vlm(arch, out, wanted, seed, vocab_size, max_positions)
        elif stale and arch in OWN_WRITERS:
            OWN_WRITERS[arch](out, wanted, seed, vocab_size, max_positions)
        elif stale:
            write_text(
                arch, out, wanted, seed, vocab_size, max_positions, layers, model_vocab, train_steps
            )
    return out


@contextmanager
def building(out: Path, stamp_name: str, wanted: dict[str, Any]) -> Iterator[bool]:
    """Yields whether `out` must be (re)written: False when its stamp `stamp_name` says
    it holds what `wanted` describes. Builders of one folder take turns (parallel test
    workers share models/): the second finds the first's stamp."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        stamp = out / stamp_name
        yield not (stamp.exists() and json.loads(stamp.read_text()) == wanted)


def build_speculation_models(models: Path) -> tuple[Path, Path]:
    """The speculative-decoding tests' and benchmark's target and one-layer draft, in
    `models`/tiny-mistral-{trained,draft}: Mistral's 16-token sliding window means the
    64-token training windows cover every attention distance, so the memorised
    continuation holds at any prompt length."""
    return (
        build("mistral", models / "tiny-mistral-trained", train_steps=80),
        build("mistral", models / "tiny-mistral-draft", seed=1, layers=1, train_steps=80),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(RECIPES), default="llama")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the arch's)")
    parser.add_argument(
        "--model-vocab",
        type=int,
        help=f"embedding/output rows, e.g. {QWEN3_VOCAB} (Qwen3's); default: the tokenizer's size",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train on the corpus for this many steps (memorises it; see train_on_corpus)",
    )
    args = parser.parse_args(argv)
    path = build(
        args.arch,
        args.out,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_positions=args.max_positions,
        layers=args.layers,
        model_vocab=args.model_vocab,
        train_steps=args.train_steps,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
