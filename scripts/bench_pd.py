"""Disaggregated prefill and decode against one server with the same engines: the TTFT
and inter-token latency (p50 / p99) of decode requests while long prompts arrive,
measured with `vllm bench serve` (vLLM's own client).

Two `vllm bench serve` clients run at once against one endpoint: the measured one sends
short prompts that decode many tokens; the other sends long prompts with few output
tokens at a steady rate. Configurations, with the same two engines in total:
- disaggregated: a prefill server and a decode server (NeuronKVConnector, payloads in a
  shared folder) behind `vllm-router --vllm-pd-disaggregation`;
- one server: `vllm serve --data-parallel-size 2` (each engine prefills and decodes).
The KV bytes moved per request are a payload file's size for the prompt lengths (the
same function writes them), from the backend's KV geometry.

    python scripts/bench_pd.py --out bench-results/pd

The same command runs on an inf2 host (the platform picks the NxD backend there; pass a
real checkpoint with --model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_client import free_port, wait_healthy  # noqa: E402
from bench_report import run_meta, write_results  # noqa: E402

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


class Processes:
    """Started processes, each logging to a file, stopped together."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serve_cmd(args: argparse.Namespace, port: int, extra: list[str]) -> list[str]:
    vllm = str(Path(sys.executable).with_name("vllm"))
    return [
        vllm, "serve", str(args.model), "--device", "neuron", "--host", "127.0.0.1",
        "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs), "--enable-prefix-caching",
        "--block-size", str(args.block_size), *extra,
    ]  # fmt: skip


def start_disaggregated(args: argparse.Namespace, procs: Processes, kv: Path) -> str:
    from neuron_plugin.core.kv_transfer import connector_config

    ports = [free_port() for _ in range(3)]
    servers = []
    # Each server its half of the host's cores, as vLLM gives each of the one server's
    # two data-parallel engines (OMP_NUM_THREADS = cores / engines): torch threads of two
    # servers that each take every core spin against each other.
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    for name, port in (("prefill", ports[1]), ("decode", ports[2])):
        cmd = serve_cmd(args, port, ["--kv-transfer-config", connector_config(str(kv))])
        servers.append((name, port, procs.start(name, cmd, threads)))
    for name, port, proc in servers:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 900, name)
    router = str(Path(sys.executable).with_name("vllm-router"))
    proc = procs.start("router", [
        router, "--host", "127.0.0.1", "--port", str(ports[0]), "--vllm-pd-disaggregation",
        "--prefill", f"http://127.0.0.1:{ports[1]}", "--decode", f"http://127.0.0.1:{ports[2]}",
        "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
    ])  # fmt: skip
    wait_healthy(f"http://127.0.0.1:{ports[0]}", proc, 120, "vllm-router")
    return f"http://127.0.0.1:{ports[0]}"


def start_one_server(args: argparse.Namespace, procs: Processes) -> str:
    port = free_port()
    proc = procs.start("one-server", serve_cmd(args, port, ["--data-parallel-size", "2"]))
    wait_healthy(f"http://127.0.0.1:{port}", proc, 900, "vllm serve")
    return f"http://127.0.0.1:{port}"


def bench_cmd(args: argparse.Namespace, url: str, out: Path, name: str, stream: str) -> list[str]:
    vllm = str(Path(sys.executable).with_name("vllm"))
    input_len, output_len, prompts, rate = {
        "decode": (args.decode_input_len, args.decode_output_len, args.decode_prompts,
                   args.decode_rate),
        "long": (args.long_input_len, args.long_output_len, args.long_prompts, args.long_rate),
    }[stream]  # fmt: skip
    return [
        vllm, "bench", "serve", "--backend", "vllm", "--base-url", url,
        "--model", str(args.model), "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "0", "--num-prompts", str(prompts),
        "--request-rate", str(rate), "--ignore-eos", "--seed", "1" if stream == "long" else "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent),
        "--result-filename", f"{out.name}-{name}-{stream}.json",
    ]  # fmt: skip


def measure(args: argparse.Namespace, url: str, name: str, logs: Path) -> dict:
    """Both clients at once; the decode client starts once long prompts are arriving."""
    with (logs / f"{name}-long-client.log").open("w") as log:
        long_client = subprocess.Popen(
            bench_cmd(args, url, args.out, name, "long"), stdout=log, stderr=subprocess.STDOUT
        )
        time.sleep(args.long_lead_s)
        subprocess.run(
            bench_cmd(args, url, args.out, name, "decode"),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        if long_client.wait() != 0:
            raise RuntimeError(f"the long-prompt client failed; see {log.name}")
    results = {}
    for stream in ("decode", "long"):
        path = args.out.parent / f"{args.out.name}-{name}-{stream}.json"
        data = json.loads(path.read_text())
        results[stream] = {k: data.get(k) for k in (*METRICS, "completed", "request_throughput")}
    return results


def kv_bytes(args: argparse.Namespace, prompt_len: int) -> int:
    """A payload's size for one prompt: the file the prefill server writes."""
    import torch

    from neuron_plugin.backends.kv_blocks import KVGeometry
    from neuron_plugin.core.checkpoint import read_hf_config, text_config
    from neuron_plugin.kv_transfer.payload import RequestScope, write_payload

    config = text_config(read_hf_config(args.model))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    geometry = KVGeometry(config["num_hidden_layers"], args.block_size,
                          config["num_key_value_heads"], head_dim, args.dtype,
                          "bench")  # fmt: skip
    blocks = math.ceil(prompt_len / args.block_size)
    kv = torch.zeros(geometry.shape(blocks), dtype=geometry.torch_dtype)
    with tempfile.TemporaryDirectory() as folder:
        return write_payload(folder, "0" * 32, kv, [0] * prompt_len, "0" * 64, geometry,
                             b"0" * 32, scope=RequestScope())  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--decode-input-len", type=int, default=32)
    parser.add_argument("--decode-output-len", type=int, default=64)
    parser.add_argument("--decode-prompts", type=int, default=24)
    parser.add_argument("--decode-rate", type=float, default=1.0)
    parser.add_argument("--long-input-len", type=int, default=768)
    parser.add_argument("--long-output-len", type=int, default=1)
    parser.add_argument("--long-prompts", type=int, default=12)
    parser.add_argument("--long-rate", type=float, default=0.3)
    parser.add_argument(
        "--long-lead-s",
        type=float,
        default=3.0,
        help="seconds of long prompts before the decode client starts",
    )
    parser.add_argument("--configs", default="disaggregated,one-server")
    parser.add_argument(
        "--repeat", type=int, default=2, help="runs of each configuration, interleaved"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "pd")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    if args.model == ROOT / "models" / "tiny-llama":
        build("llama", args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / f"{args.out.name}-logs"
    logs.mkdir(exist_ok=True)
    rows = []
    for run, name in enumerate(args.configs.split(",") * args.repeat):
        procs = Processes(logs)
        with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="neuron-kv-") as kv:
            stack.callback(procs.stop)
            if name == "disaggregated":
                url = start_disaggregated(args, procs, Path(kv))
            elif name == "one-server":
                url = start_one_server(args, procs)
            else:
                raise SystemExit(f"--configs: unknown configuration {name!r}")
            load = os.getloadavg()[0]
            result = measure(args, url, f"{name}-{run}", logs)
        # The machine's 1-minute load average when the run started (it is shared).
        rows.append({"config": name, "run": run, "load_average": round(load, 1), **result})
        print(json.dumps(rows[-1]), flush=True)
    moved = {
        "decode_request": kv_bytes(args, args.decode_input_len),
        "long_request": kv_bytes(args, args.long_input_len),
    }
    meta = run_meta(
        "bench_pd.py",
        argv,
        backend="reference",
        model=str(args.model),
        workload=(
            f"decode requests: {args.decode_prompts} x {args.decode_input_len} prompt / "
            f"{args.decode_output_len} output tokens at {args.decode_rate} req/s; long "
            f"prompts: {args.long_prompts} x {args.long_input_len} / {args.long_output_len} "
            f"at {args.long_rate} req/s"
        ),
        kv_bytes_per_request=moved,
    )
    write_results(
        args.out,
        meta,
        {"rows": rows, "kv_bytes_per_request": moved},
        [
            "configuration (2 engines)",
            "run (load average)",
            "decode requests TTFT p50 / p99 ms",
            "decode requests ITL p50 / p99 ms",
            "long prompts TTFT p50 / p99 ms",
            "completed (decode / long)",
            "KV bytes moved per request (decode / long)",
        ],
        [
            [
                r["config"],
                f"{r['run']} ({r['load_average']})",
                f"{r['decode']['median_ttft_ms']:.1f} / {r['decode']['p99_ttft_ms']:.1f}",
                f"{r['decode']['median_itl_ms']:.1f} / {r['decode']['p99_itl_ms']:.1f}",
                f"{r['long']['median_ttft_ms']:.1f} / {r['long']['p99_ttft_ms']:.1f}",
                f"{r['decode']['completed']} / {r['long']['completed']}",
                (
                    f"{moved['decode_request']:,} / {moved['long_request']:,}"
                    if r["config"] == "disaggregated"
                    else "0 / 0"
                ),
            ]
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
