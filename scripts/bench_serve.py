"""Online serving benchmark: `vllm bench serve` (vLLM's own client) against
`vllm serve MODEL --device neuron`, random-length prompts, TTFT / TPOT / throughput.

Starts the server on 127.0.0.1, waits for /health, runs the client once per request
rate, stops the server, and writes serve.json and serve.md. On an inf2 host the same
command runs unchanged (the platform picks the NxD backend there).

    python scripts/bench_serve.py --out bench-results/serve
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_client import bench_serve, free_port, wait_healthy  # noqa: E402
from bench_report import run_meta, write_results  # noqa: E402

METRICS = (
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.75,
        help="lengths drawn uniformly in [len*(1-r), len*(1+r)]",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rates", default="2,8,inf")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "serve")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    build("llama", args.model)
    vllm = str(Path(sys.executable).with_name("vllm"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    serve_cmd = [
        vllm,
        "serve",
        str(args.model),
        "--device",
        "neuron",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    rows = []
    with log.open("w") as server_log:
        server = subprocess.Popen(
            serve_cmd, stdout=server_log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        try:
            wait_healthy(url, server, 600)
            for rate in args.request_rates.split(","):
                name = f"rate-{rate}.json"
                result = bench_serve(
                    url,
                    args.model,
                    args.out.parent / f"{args.out.name}-{name}",
                    input_len=args.input_len,
                    output_len=args.output_len,
                    range_ratio=args.range_ratio,
                    prompts=args.num_prompts,
                    request_rate=rate,
                )
                rows.append({"request_rate": rate, **{k: result.get(k) for k in METRICS}})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    meta = run_meta(
        "bench_serve.py",
        argv,
        backend="reference",
        server=" ".join(serve_cmd[1:]),
        dataset=f"random, input {args.input_len}±{args.range_ratio:.0%}, output "
        f"{args.output_len}±{args.range_ratio:.0%}, {args.num_prompts} prompts",
    )
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "request rate (req/s)",
            "throughput req/s",
            "output tok/s",
            "TTFT mean / p50 / p99 ms",
            "TPOT mean / p50 / p99 ms",
        ],
        [
            [
                r["request_rate"],
                f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}",
                f"{r['mean_ttft_ms']:.1f} / {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f}",
                f"{r['mean_tpot_ms']:.2f} / {r['median_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f}",
            ]
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
