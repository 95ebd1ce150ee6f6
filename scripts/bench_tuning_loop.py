"""The loop "serve -> record -> tune -> re-serve", measured by the plugin's own telemetry.

1. Serve a workload on NxDI's default grid with `VLLM_NEURON_TRACE` recording every
   request's shape; read padded tokens per phase from the Prometheus metrics.
2. `neuron-buckets tune` the trace (context and decode phases, K buckets each) into one
   bucket-set file.
3. Serve the same workload with `override_neuron_config.bucket_set` pointing at it and
   read the metrics again.

Prompt lengths are drawn (seeded) from the ContextTokens column of the Azure LLM
inference trace 2023 (conversation), keeping lengths < max_model_len; prompts are real
token ids from the shipped corpus. Source: Azure Public Dataset, "Azure LLM inference
trace 2023" (github.com/Azure/AzurePublicDataset, AzureLLMInferenceTrace_conv.csv),
CC BY 4.0; Patel et al., "Splitwise", ISCA 2024.

    python scripts/bench_tuning_loop.py --out bench-results/tuning_loop
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from bench_client import buckets_tune  # noqa: E402
from bench_matrix import DEFAULT_TRACE, corpus_ids, prompt, trace_lengths  # noqa: E402
from bench_report import run_meta, write_results  # noqa: E402


def phase_totals() -> dict[str, float]:
    """Real and padded tokens and forward seconds per phase, from the Prometheus text
    this process serves."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            name = sample.name.removeprefix("neuron:")
            if name in ("padded_tokens_total", "real_tokens_total", "forward_seconds_sum"):
                key = f"{sample.labels['phase']}.{name}"
                totals[key] = totals.get(key, 0) + sample.value
    return totals


def serve(
    model: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    override: dict,
    max_model_len: int,
    max_num_seqs: int,
) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        seed=0,
        additional_config={"override_neuron_config": override},
    )
    from neuron_plugin.serving.telemetry import register_collector

    register_collector(llm.llm_engine.vllm_config)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    llm.generate(
        TokensPrompt(prompt_token_ids=prompts[0][:8]), SamplingParams(max_tokens=1), use_tqdm=False
    )  # one more step reports the last batch as finished
    time.sleep(1.5)  # the engine publishes its counters every 0.5 s
    totals = phase_totals()
    llm.llm_engine.engine_core.shutdown()
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-buckets", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "tuning_loop")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    from bucketing.files import dump_bucket_set, load_bucket_set

    build("llama", args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ids = corpus_ids(args.model)
    lengths = rng.choice(trace_lengths(args.trace), args.requests)
    lengths = lengths[lengths < args.max_model_len - 16]
    prompts = [prompt(ids, int(n), int(rng.integers(len(ids)))) for n in lengths]
    max_tokens = [int(m) for m in rng.integers(1, 16, len(prompts))]

    trace = args.out / "trace.jsonl"
    trace.unlink(missing_ok=True)
    os.environ["VLLM_NEURON_TRACE"] = str(trace)
    before = serve(args.model, prompts, max_tokens, {}, args.max_model_len, args.max_num_seqs)
    del os.environ["VLLM_NEURON_TRACE"]

    limits = ("--max", str(args.max_model_len), "--max-buckets", str(args.max_buckets))
    context = buckets_tune(trace, args.out / "context.yaml", "--phase", "context", *limits)
    decode = buckets_tune(trace, args.out / "decode.yaml", "--phase", "decode", *limits)
    tuned = args.out / "tuned-buckets.yaml"
    dump_bucket_set(
        tuned,
        description=f"tuned on {trace.name} by scripts/bench_tuning_loop.py",
        context_encoding_buckets=load_bucket_set(args.out / "context.yaml")[
            "context_encoding_buckets"
        ],
        token_generation_buckets=load_bucket_set(args.out / "decode.yaml")[
            "token_generation_buckets"
        ],
    )
    after = serve(
        args.model,
        prompts,
        max_tokens,
        {"bucket_set": str(tuned)},
        args.max_model_len,
        args.max_num_seqs,
    )

    meta = run_meta(
        "bench_tuning_loop.py",
        argv,
        backend="reference",
        requests=len(prompts),
        max_model_len=args.max_model_len,
    )
    table = [
        [
            phase,
            name,
            f"{run[f'{phase}.padded_tokens_total']:,.0f}",
            f"{run[f'{phase}.real_tokens_total']:,.0f}",
            f"{run[f'{phase}.forward_seconds_sum']:.2f}",
        ]
        for phase in ("context_encoding", "token_generation")
        for name, run in (("NxDI default", before), ("tuned", after))
    ]
    print(json.dumps(load_bucket_set(tuned)))
    write_results(
        args.out / "result",
        meta,
        {
            "tuned": load_bucket_set(tuned),
            "default": before,
            "tuned_run": after,
            "tuner_reports": {"context": context["report"], "decode": decode["report"]},
        },
        ["phase", "grid", "padded tokens", "real tokens", "forward s (sum)"],
        table,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
