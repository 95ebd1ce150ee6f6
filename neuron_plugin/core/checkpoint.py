"""Reading a Hugging Face checkpoint folder without loading weights: its config and its
safetensors headers. Shared by both backends and the tools, so none of them reaches into
another's module for it."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config keys at the top level: a multimodal config's
    `text_config` (transformers 5 nests it) over the outer keys (4.57 and the Hub's
    Qwen2-VL write them flat), with the outer architectures (4.57 saves them inside
    text_config only) and tie_word_embeddings (the one transformers ties by)."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config
    merged = {**config, **nested}
    merged["architectures"] = config.get("architectures") or nested.get("architectures")
    if "tie_word_embeddings" in config:
        merged["tie_word_embeddings"] = config["tie_word_embeddings"]
    return merged


def vocab_size(model_dir: str | Path) -> int:
    return int(text_config(read_hf_config(model_dir))["vocab_size"])


def safetensors_files(model_dir: str | Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def safetensors_header(model_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> its header entry (`dtype` as safetensors spells it, e.g. "I8",
    "BF16"; `shape`) over every *.safetensors file, read from the headers only
    (8-byte little-endian header length, then a JSON header)."""
    entries: dict[str, dict[str, Any]] = {}
    for path in safetensors_files(model_dir):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        entries.update({name: entry for name, entry in header.items() if name != "__metadata__"})
    return entries


def safetensors_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """Tensor name (`canonical_tensor_name`) -> shape over every *.safetensors file
    (`safetensors_header`)."""
    return {
        canonical_tensor_name(name): list(entry["shape"])
        for name, entry in safetensors_header(model_dir).items()
    }


# Vision-language checkpoints nest the decoder: Qwen3-VL's in model.language_model. (and
# the vision tower in model.visual.), transformers 4's Llava (Pixtral) in
# language_model.model. and language_model.lm_head.; the reference graphs name them as a
# text model's (model., lm_head.) and Qwen2-VL's tower (visual.).
NESTED_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def canonical_tensor_name(name: str) -> str:
    """A checkpoint tensor's name as the reference graphs know it."""
    for nested, flat in NESTED_PREFIXES:
        if name.startswith(nested):
            return flat + name.removeprefix(nested)
    return name


# Files whose loading unpickles (torch.load), which can run code: never read.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def pickle_files(folder: str | Path) -> list[str]:
    """The pickled weight files in a folder, by name."""
    return sorted(p.name for p in Path(folder).iterdir() if p.suffix in PICKLE_SUFFIXES)


@contextmanager
def replacing_folder(out: str | Path) -> Iterator[Path]:
    """A staging folder beside `out` that replaces `out` whole when the block completes
    (removed if it raises): a reader never sees a half-written checkpoint."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
