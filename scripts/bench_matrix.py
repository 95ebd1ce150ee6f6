"""The findings' benchmark matrix on this plugin: bucketing on/off x prefix caching on/off
x fixed/variable prompt lengths, through vLLM and through the backend directly.

Setup mirrors NEURON_FINDINGS.md (Qwen3-style model, max_model_len 2048, max_num_seqs 4,
block_size 32, batches of 4 prompts scored with one output token each, 3 warm-up then N
measured iterations) on the tiny local Qwen3 checkpoint. Prompts are real token ids from
the shipped corpus, never max-length dummies:
- fixed: the same four 97-token prompts every iteration (with prefix caching on, every
  iteration after the first is a full cache hit, as in the study);
- variable: four fresh prompts per iteration whose lengths are drawn (seeded) from the
  ContextTokens column of the Azure LLM inference trace 2023 (conversation), keeping
  lengths < 2048. Source: Azure Public Dataset, "Azure LLM inference trace 2023"
  (github.com/Azure/AzurePublicDataset, AzureLLMInferenceTrace_conv.csv), CC BY 4.0;
  Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting",
  ISCA 2024. The copy read here is scripts/data/azure_llm_inference_conv_2023.csv
  (attribution in scripts/data/README.md), or --trace.
"direct" drives the backend without vLLM (prefill each prompt through the plugin's
input preparation and first-fit bucket pick), like the study's NxD-direct rows; it runs
with prefix caching off only, as the study did.

    python scripts/bench_matrix.py --iterations 20 --out bench-results/matrix
writes matrix.json and matrix.md (mean, p50, p99 and a 95% confidence interval of the
mean, per batch, in ms).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from bench_report import run_meta, write_results  # noqa: E402

MAX_MODEL_LEN = 2048
BATCH = 4
FIXED_LENGTH = 97
WARMUP = 3
DEFAULT_TRACE = ROOT / "scripts" / "data" / "azure_llm_inference_conv_2023.csv"


def corpus_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    text = (ROOT / "scripts" / "corpus" / "tiny_corpus.txt").read_text()
    return AutoTokenizer.from_pretrained(model)(text)["input_ids"]


def trace_lengths(path: Path) -> np.ndarray:
    with path.open() as f:
        lengths = [int(row["ContextTokens"]) for row in csv.DictReader(f)]
    return np.array([n for n in lengths if 0 < n < MAX_MODEL_LEN])


def prompt(ids: list[int], length: int, offset: int) -> list[int]:
    return [ids[(offset + i) % len(ids)] for i in range(length)]


def workloads(ids: list[int], lengths: np.ndarray, iterations: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    fixed = [prompt(ids, FIXED_LENGTH, 101 * j) for j in range(BATCH)]
    total = WARMUP + iterations
    variable = [
        [prompt(ids, int(n), int(rng.integers(len(ids)))) for n in rng.choice(lengths, BATCH)]
        for _ in range(total)
    ]
    return {"fixed": [fixed] * total, "variable": variable}


def stats(ms: list[float]) -> dict:
    ordered = sorted(ms)
    mean = statistics.fmean(ms)
    half = 1.96 * statistics.stdev(ms) / math.sqrt(len(ms)) if len(ms) > 1 else 0.0
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "mean_ms": mean,
        "p50_ms": statistics.median(ms),
        "p99_ms": p99,
        "ci95_ms": [mean - half, mean + half],
        "n": len(ms),
    }


def override(bucketing: bool) -> dict:
    return {} if bucketing else {"enable_bucketing": False}


def run_vllm(model: Path, bucketing: bool, prefix: bool, loads: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=BATCH,
        block_size=32,
        enable_prefix_caching=prefix,
        enable_chunked_prefill=False,
        seed=0,
        additional_config={"override_neuron_config": override(bucketing)},
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    results = {}
    for name, batches in loads.items():
        times = []
        for batch in batches:
            start = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            times.append(1000 * (time.perf_counter() - start))
        results[name] = stats(times[WARMUP:])
    llm.llm_engine.engine_core.shutdown()
    return results


def run_direct(model: Path, bucketing: bool, loads: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.backends.loader import load_backend
    from neuron_plugin.core.inputs import context_encoding_inputs
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = EngineArgs(
        model=str(model),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=BATCH,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        additional_config={"override_neuron_config": override(bucketing)},
    ).create_engine_config()
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
    backend, _ = load_backend(settings, model)
    results = {}
    for name, batches in loads.items():
        times = []
        for batch in batches:
            start = time.perf_counter()
            for slot, p in enumerate(batch):
                inputs = context_encoding_inputs(settings, np.asarray(p), 0, slot, None)
                int(backend.forward(inputs).argmax())
            times.append(1000 * (time.perf_counter() - start))
        results[name] = stats(times[WARMUP:])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-qwen3")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "matrix")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    build("qwen3", args.model)
    loads = workloads(corpus_ids(args.model), trace_lengths(args.trace), args.iterations, args.seed)
    rows = []
    for bucketing in (False, True):
        for name, result in run_direct(args.model, bucketing, loads).items():
            rows.append(
                {
                    "path": "direct",
                    "bucketing": bucketing,
                    "prefix_caching": False,
                    "workload": name,
                    **result,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        for prefix in (False, True):
            for name, result in run_vllm(args.model, bucketing, prefix, loads).items():
                rows.append(
                    {
                        "path": "vllm",
                        "bucketing": bucketing,
                        "prefix_caching": prefix,
                        "workload": name,
                        **result,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    meta = run_meta(
        "bench_matrix.py",
        argv,
        backend="reference",
        model=args.model.name,
        max_model_len=MAX_MODEL_LEN,
        batch=BATCH,
        warmup=WARMUP,
        iterations=args.iterations,
    )
    on = {True: "on", False: "off"}
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "path",
            "bucketing",
            "prefix caching",
            "workload",
            "mean ms",
            "p50 ms",
            "p99 ms",
            "95% CI ms",
        ],
        [
            [
                r["path"],
                on[r["bucketing"]],
                on[r["prefix_caching"]],
                r["workload"],
                f"{r['mean_ms']:.2f}",
                f"{r['p50_ms']:.2f}",
                f"{r['p99_ms']:.2f}",
                f"{r['ci95_ms'][0]:.2f}-{r['ci95_ms'][1]:.2f}",
            ]
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
