"""Speculative decoding: decode tokens/s and inter-token latency with and without
speculation (prompt lookup, a draft model fused into the graphs, and EAGLE / EAGLE-3
heads) at batch 1 and 8 (--batches), on a repetitive workload and on the Azure trace's
lengths, as ratios to no speculation measured in one run.

The target is a tiny Mistral trained on the corpus until it memorises it, the draft a
one-layer Mistral trained the same way (scripts/build_tiny_model.py --train-steps) and
the EAGLE heads are trained on the target's hidden states (scripts/build_eagle_heads.py):
with random weights no draft would be accepted. Workloads (prompt text is corpus text, the
only text these models know):
- *edit*: a corpus passage followed by its own first 24 tokens, so the answer copies the
  passage: the shape of a code edit, where prompt lookup shines;
- *azure*: prompt and output lengths of the Azure LLM inference trace (conversation,
  2023; scripts/data/azure_llm_inference_conv_2023.csv, CC BY 4.0, see
  scripts/data/README.md), prompts cut to 384 tokens and outputs to 64 so they fit the
  tiny models' context; the continuation of a passage is the corpus, which prompt lookup
  finds only where the passage repeats itself.

Drives the real engine (`vllm.LLM`, reference backend). Per request: inter-token latency
= (last token - first token) / (tokens - 1), the mean gap a client sees (speculation
delivers tokens in bursts); decode tokens/s = tokens after each request's first / the
time from the batch's first first-token to its last token; tokens per step = a request's
tokens after its first / the engine steps that delivered any (1 without speculation, up
to num_speculative_tokens + 1 with it). Each figure is the median of --repeats runs.

    python scripts/bench_speculation.py --out bench-results/speculation
writes speculation.json and speculation.md; the EAGLE figures of the docs:

    python scripts/bench_speculation.py --methods none,eagle,eagle3 --batches 1,4,16 \
        --batch-graphs --requests 8 --repeats 3 --out bench-results/speculation-eagle
 On an inf2/trn host: VLLM_NEURON_BACKEND=nxd,
--python the Neuron SDK's interpreter, --target/--draft real checkpoints.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

TRACE = ROOT / "scripts" / "data" / "azure_llm_inference_conv_2023.csv"
BATCHES = (1, 8)
MAX_MODEL_LEN = 512
PROMPT_CAP, OUTPUT_CAP = 384, 64
METHODS = ("none", "ngram", "draft_model", "eagle", "eagle3")


def corpus_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    text = (ROOT / "scripts" / "corpus" / "tiny_corpus.txt").read_text()
    return AutoTokenizer.from_pretrained(model)(text)["input_ids"]


def passage(ids: list[int], length: int, offset: int) -> list[int]:
    return [ids[(offset + i) % len(ids)] for i in range(length)]


def workloads(model: Path, requests: int) -> dict[str, list[tuple[list[int], int]]]:
    """(prompt, output tokens) per request of each workload."""
    ids = corpus_ids(model)
    rng = np.random.default_rng(0)
    edit = []
    for _ in range(requests):
        text = passage(ids, int(rng.integers(120, 300)), int(rng.integers(0, len(ids))))
        edit.append((text + text[:24], 96))
    with TRACE.open() as f:
        rows = list(csv.DictReader(f))
    picked = rng.choice(len(rows), size=requests, replace=False)
    azure = [
        (
            passage(
                ids,
                max(8, min(int(rows[i]["ContextTokens"]), PROMPT_CAP)),
                int(rng.integers(0, len(ids))),
            ),
            max(2, min(int(rows[i]["GeneratedTokens"]), OUTPUT_CAP)),
        )
        for i in picked
    ]
    return {"edit": edit, "azure": azure}


def make_llm(
    target: Path,
    draft: Path,
    heads: dict[str, Path],
    method: str,
    drafts: int,
    python: str | None,
    batches: tuple[int, ...],
    batch_graphs: bool,
):
    from vllm import LLM

    speculative = {
        "none": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": drafts,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        "draft_model": {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": drafts,
        },
        **{
            name: {"method": name, "model": str(head), "num_speculative_tokens": drafts}
            for name, head in heads.items()
        },
    }[method]
    return LLM(
        model=str(target),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(batches),
        seed=0,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        gpu_memory_utilization=0.1,
        speculative_config=speculative,
        additional_config={
            "override_neuron_config": {
                "context_encoding_buckets": [64, 128, 256, 512],
                # a token-generation graph per batch size, so batch 1 computes one row
                **({"token_generation_batches": list(batches)} if batch_graphs else {}),
            },
            **({"backend_python": python} if python else {}),
        },
    )


def run_batch(
    llm, requests: list[tuple[list[int], int]]
) -> tuple[list[float], list[float], float, int]:
    """All `requests` at once: (each request's mean inter-token gap, each request's
    tokens per engine step that delivered any, decode seconds, tokens after each
    request's first)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    for i, (prompt, tokens) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    deliveries: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            request, n = out.request_id, len(out.outputs[0].token_ids)
            if n <= count.get(request, 0):
                continue
            if request in first:
                deliveries[request] = deliveries.get(request, 0) + 1
            else:
                first[request] = now
            last[request], count[request] = now, n
    decoded = [r for r in first if count[r] > 1]
    gaps = [(last[r] - first[r]) / (count[r] - 1) for r in decoded]
    per_step = [(count[r] - 1) / deliveries[r] for r in decoded]
    seconds = max(last.values()) - min(first.values())
    return gaps, per_step, seconds, sum(n - 1 for n in count.values())


def measure(llm, requests: list[tuple[list[int], int]], batch: int) -> dict[str, float]:
    """Requests `batch` at a time, in order."""
    gaps: list[float] = []
    per_step: list[float] = []
    seconds, tokens = 0.0, 0
    for start in range(0, len(requests), batch):
        g, p, s, t = run_batch(llm, requests[start : start + batch])
        gaps += g
        per_step += p
        seconds += s
        tokens += t
    return {
        "tokens_per_s": tokens / seconds,
        "itl_ms": 1e3 * statistics.median(gaps),
        "tokens_per_step": statistics.median(per_step),
    }


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    base = {(r["workload"], r["batch"]): r for r in rows if r["method"] == "none"}
    lines = []
    for r in rows:
        b = base[(r["workload"], r["batch"])]
        lines.append(
            [
                r["workload"],
                str(r["batch"]),
                r["method"],
                f"{r['tokens_per_s']:.1f}",
                f"{r['itl_ms']:.2f}",
                f"{r['tokens_per_step']:.2f}",
                f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}",
                f"{r['itl_ms'] / b['itl_ms']:.2f}",
            ]
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per workload")
    parser.add_argument("--drafts", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "speculation")
    parser.add_argument(
        "--target", type=Path, help="target checkpoint (default: the corpus-trained tiny one)"
    )
    parser.add_argument("--draft", type=Path, help="draft checkpoint of the same vocabulary")
    parser.add_argument(
        "--python", help="the backend runner's interpreter (default: the backend in-process)"
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS[:3]), help=f"comma-separated, of {METHODS}"
    )
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes"
    )
    parser.add_argument(
        "--batch-graphs",
        action="store_true",
        help="compile a token-generation graph per --batches size (token_generation_batches; "
        "the reference backend only with speculation) instead of all at the largest",
    )
    args = parser.parse_args(argv)
    from build_eagle_heads import build_head
    from build_tiny_model import build_speculation_models

    methods = tuple(args.methods.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "none" not in methods:
        parser.error(f"--methods: {unknown} not in {METHODS}, or 'none' (the baseline) missing")
    if args.target and args.draft:
        target, draft = args.target, args.draft
    elif args.target or args.draft:
        parser.error("--target and --draft go together")
    else:
        target, draft = build_speculation_models(ROOT / "models")
    heads = {
        m: build_head(target, ROOT / "models" / f"tiny-mistral-{m}", m)
        for m in methods
        if m.startswith("eagle")
    }
    loads = workloads(target, args.requests)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["VLLM_NEURON_CACHE_URL"] = cache
        for method in methods:
            llm = make_llm(
                target, draft, heads, method, args.drafts, args.python, batches, args.batch_graphs
            )
            try:
                run_batch(llm, loads["edit"][:2])  # warm-up
                for name, requests in loads.items():
                    for batch in batches:
                        runs = [measure(llm, requests, batch) for _ in range(args.repeats)]
                        row = {
                            "workload": name,
                            "batch": batch,
                            "method": method,
                            **{key: statistics.median(r[key] for r in runs) for key in runs[0]},
                        }
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            finally:
                llm.llm_engine.engine_core.shutdown()
    rows.sort(key=lambda r: (r["workload"], r["batch"], METHODS.index(r["method"])))
    meta = run_meta(
        "bench_speculation.py",
        argv,
        drafts=args.drafts,
        requests=args.requests,
        repeats=args.repeats,
        max_model_len=MAX_MODEL_LEN,
        batch_graphs=args.batch_graphs,
    )
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "workload",
            "batch",
            "speculation",
            "decode tokens/s",
            "inter-token ms (median)",
            "tokens per step (median)",
            "tokens/s vs none",
            "inter-token vs none",
        ],
        table_rows(rows),
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
    sys.exit(main())
