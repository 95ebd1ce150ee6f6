"""Helpers for the end-to-end tests: the transformers oracle, corpus prompts, engines."""

from __future__ import annotations

import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
