"""Weights trained on the corpus until they memorise it, for the speculative-decoding
tests and benchmark (random weights accept almost no draft)."""

from __future__ import annotations

from tiny_models.common import CORPUS


def train_on_corpus(model, tokenizer, steps: int, seed: int) -> None:
    """Train `model` (next-token loss, AdamW) on random 64-token windows of the corpus.
    The corpus is small, so the model memorises it: its greedy continuation of corpus
    text is the corpus. That makes a stand-in for the workloads speculative decoding is
    for (an edit that copies most of its input, for prompt lookup; a draft model that
    agrees with the target) where random weights would accept almost no draft."""
    import torch

    ids = torch.tensor(tokenizer(CORPUS.read_text())["input_ids"])
    window, batch = 64, 16
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window, (batch,), generator=generator)
        inputs = torch.stack([ids[s : s + window] for s in starts.tolist()])
        model(inputs, labels=inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
