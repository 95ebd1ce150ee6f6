"""How far sampling clamped to global_topk is from exact sampling: the total variation
distance between vLLM's distribution for a request without top_k (temperature T, top-p p,
whole vocabulary) and the one the on-device sampler draws from by default (top-k
global_topk first, then the same temperature and top-p), row by row over logits at
Qwen3's 151,936-token vocabulary.

Both distributions are vLLM's own arithmetic: `apply_top_k_top_p` from
vllm.v1.sample.ops.topk_topp_sampler on logits / T, then a softmax (what vLLM's Sampler
draws from); the clamped one passes k = global_topk, the exact one none. The distance is
1/2 sum |P - Q| per row, in float64: the largest difference any event's probability can
have under the two. It comes out at about the probability (at temperature T) outside the
row's global_topk most likely tokens, whatever the top-p: the clamped top-p cut is taken
over the renormalised top-k mass, so it keeps the same share of a smaller set.

Three sources of logits:
- checkpoint: the last-layer logits of a Hugging Face checkpoint (default: the one-layer
  Qwen3-shaped checkpoint of scripts/build_tiny_model.py with 151,936 vocabulary rows) at
  every position of prompts cut from scripts/corpus/tiny_corpus.txt. That checkpoint's
  weights are random, so its logits are nearly flat: a worst case, not a trained model.
  `--model` takes a real checkpoint (and `--text` real prompts) on a host that has one.
- zipf: SYNTHETIC heavy-tailed rows, logit of the token of rank r = -s ln r over a random
  permutation of 151,936 tokens, each row with its own exponent s drawn uniformly from
  [1.0, 2.0] (entropy at T 1 from 8.2 nats down to 1.6, median 3.2: flatter than a
  trained model's typical next-token distribution, so the gap is if anything overstated).
- zipf s=1: one flat Zipf row (a unigram-like distribution, 51% of its mass outside the
  top 256): the far end of what a trained model produces.

    python scripts/bench_sampling_gap.py --out bench-results/sampling_gap
writes sampling_gap.json and sampling_gap.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

TEMPERATURES = (0.7, 1.0)
TOP_PS = (0.8, 0.9, 0.95, 1.0)
GLOBAL_TOPK = 256
VOCAB = 151_936
CORPUS = ROOT / "scripts" / "corpus" / "tiny_corpus.txt"
PROMPT = 32
CHUNK = 32  # rows per vLLM call: bounds the sort's memory


def checkpoint_logits(model: Path, text: Path, rows: int) -> torch.Tensor:
    """[rows, vocab] float32 logits: every position of consecutive PROMPT-token windows
    of `text`, tokenised with the checkpoint's tokenizer, wrapping around as needed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(text.read_text())["input_ids"]
    windows = -(-rows // PROMPT)
    needed = windows * PROMPT
    ids = (ids * (needed // len(ids) + 1))[:needed]
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for w in range(windows):
            prompt = torch.tensor([ids[w * PROMPT : (w + 1) * PROMPT]])
            out.append(net(input_ids=prompt).logits[0].float())
    return torch.cat(out)[:rows].contiguous()


def zipf_logits(exponents: np.ndarray, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] float32 logits: row i gives the token of rank r the logit
    -exponents[i] * ln r, the ranks spread over the vocabulary by a random permutation."""
    rng = np.random.default_rng(seed)
    log_rank = np.log(np.arange(1, vocab + 1, dtype=np.float64))
    rows = np.empty((len(exponents), vocab), dtype=np.float32)
    for i, s in enumerate(exponents):
        rows[i, rng.permutation(vocab)] = -s * log_rank
    return torch.from_numpy(rows)


def total_variation(logits: torch.Tensor, temperature: float, top_p: float, k: int) -> np.ndarray:
    """Per row: TV between vLLM's distribution without top-k and with top-k `k`, both at
    `temperature` and `top_p` (1.0: no top-p, which vLLM passes as None)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    out = []
    for chunk in logits.split(CHUNK):
        rows = chunk.shape[0]
        p = None if top_p >= 1.0 else torch.full((rows,), top_p, dtype=torch.float32)
        scaled = chunk / temperature
        exact = apply_top_k_top_p(scaled.clone(), None, p).double().softmax(-1)
        k_rows = torch.full((rows,), k, dtype=torch.long)
        clamped = apply_top_k_top_p(scaled.clone(), k_rows, p).double().softmax(-1)
        out.append(0.5 * (exact - clamped).abs().sum(-1))
    return torch.cat(out).numpy()


def top_mass(logits: torch.Tensor, temperature: float, k: int) -> np.ndarray:
    """Per row: the probability at `temperature` of its k most likely tokens."""
    probs = (logits.double() / temperature).softmax(-1)
    return probs.topk(k, dim=-1).values.sum(-1).numpy()


def summary(values: np.ndarray) -> dict[str, float]:
    return {
        "median": float(np.median(values)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=ROOT / "models" / "qwen3-vocab151936",
        help="a Hugging Face checkpoint (default: built with scripts/build_tiny_model.py)",
    )
    parser.add_argument("--text", type=Path, default=CORPUS, help="prompts' text")
    parser.add_argument("--rows", type=int, default=256, help="rows per source")
    parser.add_argument("--global-topk", type=int, default=GLOBAL_TOPK)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "sampling_gap")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.model == parser.get_default("model"):
        from build_tiny_model import QWEN3_VOCAB, build

        build("qwen3", args.model, layers=1, model_vocab=QWEN3_VOCAB)
    checkpoint = checkpoint_logits(args.model, args.text, args.rows)
    vocab = checkpoint.shape[1]
    exponents = np.random.default_rng(args.seed).uniform(1.0, 2.0, args.rows)
    sources = {
        "checkpoint": checkpoint,
        "zipf": zipf_logits(exponents, vocab, args.seed + 1),
        "zipf s=1": zipf_logits(np.ones(1), vocab, args.seed + 2),
    }
    k = args.global_topk
    rows = []
    for temperature in TEMPERATURES:
        mass = {name: summary(top_mass(x, temperature, k)) for name, x in sources.items()}
        for top_p in TOP_PS:
            row: dict = {"temperature": temperature, "top_p": top_p}
            for name, logits in sources.items():
                row[name] = summary(total_variation(logits, temperature, top_p, k))
                row[f"{name} top-{k} mass"] = mass[name]
            print(row, flush=True)
            rows.append(row)
    meta = run_meta(
        "bench_sampling_gap.py",
        argv,
        vocab=vocab,
        rows=args.rows,
        global_topk=k,
        model=str(args.model),
        zipf_exponents="uniform [1.0, 2.0] per row",
    )

    def cell(stats: dict[str, float], *keys: str) -> str:
        return " / ".join(f"{stats[key]:.4f}" for key in keys)

    table = [
        [
            f"{r['temperature']}",
            f"{r['top_p']}",
            cell(r["checkpoint"], "median", "max"),
            cell(r["zipf"], "median", "p90", "p99", "max"),
            cell(r["zipf s=1"], "max"),
            " / ".join(f"{r[f'{name} top-{k} mass']['median']:.4f}" for name in sources),
        ]
        for r in rows
    ]
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "T",
            "top_p",
            "checkpoint (random weights) TV median / max",
            "synthetic Zipf TV median / p90 / p99 / max",
            "Zipf s=1 TV",
            f"top-{k} mass at T: checkpoint / Zipf (medians) / Zipf s=1",
        ],
        table,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
    sys.exit(main())
