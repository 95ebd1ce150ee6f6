"""Shared fixtures: the tiny checkpoints, a per-session compile cache, the transformers
oracle, and one vLLM engine per configuration (an engine takes ~25 s to start here)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

# Engines in this suite run the plugin's reference backend. Set before vLLM is imported
# so every process vLLM spawns inherits it.
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    """Both tiny checkpoints, built once into models/ (idempotent)."""
    from build_tiny_model import build

    return {arch: build(arch, ROOT / "models" / f"tiny-{arch}") for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session", autouse=True)
def compile_cache_dir(tmp_path_factory) -> Path:
    """A fresh compile cache per test session, shared by every engine in it."""
    path = tmp_path_factory.mktemp("compile-cache")
    os.environ["VLLM_NEURON_CACHE_URL"] = str(path)
    return path


class GreedyOracle:
    """Greedy continuations from Hugging Face transformers (float32), the outside oracle."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = self.model(ids, use_cache=True)
            tokens = []
            for _ in range(max_new_tokens):
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                out = self.model(torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                                 use_cache=True)
        return tokens


@pytest.fixture(scope="session")
def oracles(model_dirs):
    cache: dict[str, GreedyOracle] = {}

    def get(arch: str) -> GreedyOracle:
        if arch not in cache:
            cache[arch] = GreedyOracle(model_dirs[arch])
        return cache[arch]

    return get


def corpus_token_ids(model_dir: Path, count: int, offset: int = 0) -> list[int]:
    """`count` real token ids from the shipped corpus (wrapping), starting at `offset`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = (ROOT / "scripts" / "corpus" / "tiny_corpus.txt").read_text()
    ids = tokenizer(text)["input_ids"]
    return [ids[(offset + i) % len(ids)] for i in range(count)]


def make_llm(model_dir: Path, **kwargs):
    from vllm import LLM

    defaults = dict(model=str(model_dir), dtype="float32", max_model_len=256,
                    max_num_seqs=4, seed=0, enable_prefix_caching=False,
                    enable_chunked_prefill=False,
                    gpu_memory_utilization=0.1)
    defaults.update(kwargs)
    return LLM(**defaults)


def shutdown_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
