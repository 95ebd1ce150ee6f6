"""Load test against plain vLLM: `vllm bench serve` (vLLM's own load client) at several
concurrencies against `vllm serve MODEL --device neuron` and against plain vLLM's own
platform (the same venv with VLLM_PLUGINS set to load no plugin), on the same checkpoint
and flags, streamed completions. The servers run side by side and each level is measured
against one after the other (the idle one waits), so the drift of this shared machine
falls between runs seconds apart, not minutes; each level runs `--repeat` times (3),
the side that goes first alternating, and the table gives the medians and the median
and range of the per-repeat ratios (every run is in the JSON).

Per side and concurrency: output tokens/s, inter-token latency (ITL) and time to first
token percentiles, failed requests; for the plugin the padded share of its decode work
read from its own telemetry (`neuron:bucket_real_rows_total` against
`neuron:bucket_rows_total` of the token-generation buckets, and
`neuron:padded_tokens_total`), the decode batch buckets used, and its backend calls and
their seconds per phase (`neuron:forward_seconds`). With `--busy`, the same levels run
again with one busy process per core beside the servers (the same for both sides). With
`--tune`, the plugin's run records every request's shape (`VLLM_NEURON_TRACE`),
`neuron-buckets tune --phase both --pair batch` learns context lengths and decode
(batch, length) buckets from it, and a second round measures the plugin on those buckets
(`override_neuron_config.bucket_set`) against plain vLLM again: the tuning loop a user
runs, measured with the same client.

The servers get no OMP_NUM_THREADS from this script's environment: each runs with its
own thread defaults (`--omp-num-threads N` gives both N). Writes OUT.json and OUT.md.

    python scripts/bench_load.py --busy --tune --out bench-results/load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_client import bench_serve, buckets_tune, free_port, wait_healthy  # noqa: E402
from bench_report import run_meta, write_results  # noqa: E402

SIDES = ("plugin", "plain")
METRICS = (
    "completed",
    "failed",
    "output_throughput",
    "median_itl_ms",
    "p90_itl_ms",
    "median_tpot_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "duration",
)


def decode_counters(url: str) -> dict[str, Any]:
    """The plugin's decode rows (real and all), padded tokens, the rows of each
    token-generation bucket and its backend calls and their seconds per phase
    (`neuron:forward_seconds`), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, Any] = {"rows": 0.0, "real_rows": 0.0, "padded_tokens": 0.0, "buckets": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "neuron:padded_tokens_total":
                found["padded_tokens"] += sample.value
            for suffix, key in (("_sum", "seconds"), ("_count", "calls")):
                if sample.name == "neuron:forward_seconds" + suffix:
                    name = f"{labels.get('phase', '?')}_{key}"
                    found[name] = found.get(name, 0.0) + sample.value
            if labels.get("phase") != "token_generation":
                continue
            if sample.name == "neuron:bucket_rows_total":
                found["rows"] += sample.value
                bucket = labels.get("bucket", "?")
                found["buckets"][bucket] = found["buckets"].get(bucket, 0.0) + sample.value
            elif sample.name == "neuron:bucket_real_rows_total":
                found["real_rows"] += sample.value
    return found


def padding(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    rows = after["rows"] - before["rows"]
    real = after["real_rows"] - before["real_rows"]
    used = {
        bucket: rows_after - before["buckets"].get(bucket, 0.0)
        for bucket, rows_after in after["buckets"].items()
        if rows_after - before["buckets"].get(bucket, 0.0) > 0
    }
    calls = {}
    for phase in ("context_encoding", "token_generation"):
        count = after.get(f"{phase}_calls", 0.0) - before.get(f"{phase}_calls", 0.0)
        seconds = after.get(f"{phase}_seconds", 0.0) - before.get(f"{phase}_seconds", 0.0)
        calls[f"{phase}_calls"] = count
        calls[f"{phase}_seconds"] = round(seconds, 3)
    return {
        "decode_rows": rows,
        "decode_real_rows": real,
        "padded_row_share": round(1 - real / rows, 4) if rows else None,
        "padded_tokens": after["padded_tokens"] - before["padded_tokens"],
        "decode_bucket_rows": used,
        **calls,
    }


def run_client(args: argparse.Namespace, url: str, concurrency: int, prompts: int, name: str):
    result = bench_serve(
        url,
        args.model,
        args.out.parent / name,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=0,
        prompts=prompts,
        seed=args.seed,
        extra=(
            "--max-concurrency", str(concurrency), "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,90,99", "--disable-tqdm",
        ),
    )  # fmt: skip
    result["failed"] = int(result.get("num_prompts", prompts)) - int(result.get("completed", 0))
    return result


def busy_processes(count: int) -> list[subprocess.Popen]:
    """One pure-Python spinning process per core: the same load beside either server."""
    return [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(count)]


def tune(args: argparse.Namespace, trace: Path) -> Path:
    """The bucket set `neuron-buckets tune` learns from the plugin run's trace: both
    phases' lengths and the decode batch sizes, as docs/configuration/buckets.md says."""
    tuned = args.out.with_name(f"{args.out.name}-tuned-buckets.yaml")
    buckets_tune(
        trace, tuned, "--phase", "both", "--pair", "batch",
        "--max-num-seqs", str(args.max_num_seqs), "--max", str(args.max_model_len),
    )  # fmt: skip
    return tuned


def server_command(args: argparse.Namespace, side: str, port: int) -> list[str]:
    vllm = str(Path(sys.executable).with_name("vllm"))
    command = [vllm, "serve", str(args.model)]
    if side == "plugin":
        command += ["--device", "neuron"]
    command += [
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
    if side == "plain":
        # vLLM's CPU platform sizes its KV cache from host memory otherwise
        command += ["--kv-cache-memory-bytes", str(args.plain_kv_bytes)]
    return command + args.server_arg


def server_env(args: argparse.Namespace, side: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if args.omp_num_threads:
        env["OMP_NUM_THREADS"] = str(args.omp_num_threads)
    if side == "plain":
        env = {k: v for k, v in env.items() if not k.startswith("VLLM_NEURON")}
        env["VLLM_PLUGINS"] = ""  # no platform plugin: vLLM's own CPU platform
    return env


@dataclass
class Served:
    """A running server the levels are measured against: its row name, side, URL."""

    label: str
    side: str
    url: str


@contextmanager
def serving(
    args: argparse.Namespace,
    side: str,
    label: str,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Served]:
    """`side`'s server (its command plus `extra` arguments and `env`), started, warmed
    up and, on leaving, stopped; its log beside the results."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out.with_name(f"{args.out.name}-{label}.server.log")
    with log.open("w") as server_log:
        server = subprocess.Popen(
            server_command(args, side, port) + (extra or []),
            stdout=server_log,
            stderr=subprocess.STDOUT,
            env={**server_env(args, side), **(env or {})},
        )
        try:
            wait_healthy(url, server, args.startup_timeout)
            run_client(args, url, 4, 8, f"{args.out.name}-{label}-warmup.json")
            yield Served(label, side, url)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def measure(
    args: argparse.Namespace, servers: list[Served], cores: int, round_: int
) -> list[dict[str, Any]]:
    """Every condition and level against each server in turn, `--repeat` times, the
    servers' runs of one level back to back (the first server of a repeat alternates):
    the machine's drift between the sides' runs of a level is then seconds, not the
    minutes a whole side takes (servers idle while another is measured), and neither
    side always runs first."""
    rows = []
    for condition in ("quiet", "busy") if args.busy else ("quiet",):
        spinning = busy_processes(cores) if condition == "busy" else []
        try:
            for level in args.concurrency:
                prompts = max(args.min_prompts, args.rounds * level)
                for repeat in range(1, args.repeat + 1):
                    for served in servers if repeat % 2 else servers[::-1]:
                        where = (round_, condition, level, repeat)
                        row = measure_level(args, served, where, prompts)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for proc in spinning:
                proc.kill()
                proc.wait()
    return rows


def measure_level(
    args: argparse.Namespace, served: Served, where: tuple[int, str, int, int], prompts: int
) -> dict[str, Any]:
    """One client run against `served` at (round, condition, concurrency, repeat): its
    metrics and, for the plugin, what its telemetry counted during the run."""
    round_, condition, level, repeat = where
    name = f"{args.out.name}-{served.label}-r{round_}-{condition}-c{level}-{repeat}.json"
    before = decode_counters(served.url) if served.side == "plugin" else None
    result = run_client(args, served.url, level, prompts, name)
    row = {
        "side": served.label,
        "round": round_,
        "condition": condition,
        "concurrency": level,
        "repeat": repeat,
        "prompts": prompts,
        **{k: result.get(k) for k in METRICS},
    }
    if before is not None:
        time.sleep(1.0)  # engines publish their counters every 0.5 s
        row.update(padding(before, decode_counters(served.url)))
    return row


KEY = ("round", "condition", "concurrency")


def paired(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each plugin run with plain vLLM's run of the same round, level and repeat."""
    plain = {tuple(r[k] for k in (*KEY, "repeat")): r for r in rows if r["side"] == "plain"}
    pairs = []
    for r in rows:
        base = plain.get(tuple(r[k] for k in (*KEY, "repeat")))
        if r["side"].startswith("plugin") and base is not None:
            pairs.append((r, base))
    return pairs


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per plugin server, round, condition and level: the medians of its runs and of
    plain vLLM's, and the median (and range) of the per-repeat ratios: a ratio of two
    runs seconds apart, the figure this shared machine's drift disturbs least."""
    groups: dict[tuple, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for plugin, plain in paired(rows):
        groups.setdefault((plugin["side"], *(plugin[k] for k in KEY)), []).append((plugin, plain))
    out = []
    for (side, round_, condition, level), pairs in groups.items():
        ratios = [
            p["output_throughput"] / b["output_throughput"]
            for p, b in pairs
            if b["output_throughput"]
        ]
        itl = [p["median_itl_ms"] / b["median_itl_ms"] for p, b in pairs if b["median_itl_ms"]]
        share = [p["padded_row_share"] for p, _ in pairs if p.get("padded_row_share") is not None]
        out.append(
            {
                "side": side,
                "round": round_,
                "condition": condition,
                "concurrency": level,
                "repeats": len(pairs),
                "plugin_tok_s": statistics.median(p["output_throughput"] for p, _ in pairs),
                "plain_tok_s": statistics.median(b["output_throughput"] for _, b in pairs),
                "plugin_itl_ms": statistics.median(p["median_itl_ms"] for p, _ in pairs),
                "plain_itl_ms": statistics.median(b["median_itl_ms"] for _, b in pairs),
                "tok_s_ratio": statistics.median(ratios) if ratios else None,
                "tok_s_ratio_range": [min(ratios), max(ratios)] if ratios else None,
                "itl_ratio": statistics.median(itl) if itl else None,
                "itl_ratio_range": [min(itl), max(itl)] if itl else None,
                "failed": sum(p["failed"] + b["failed"] for p, b in pairs),
                "padded_row_share": statistics.median(share) if share else None,
                "decode_buckets": most_rows([p.get("decode_bucket_rows", {}) for p, _ in pairs]),
            }
        )
    return out


def most_rows(runs: list[dict[str, float]]) -> list[str]:
    """The three decode buckets that ran the most rows over `runs` (rows per bucket)."""
    rows: dict[str, float] = {}
    for run in runs:
        for bucket, count in run.items():
            rows[bucket] = rows.get(bucket, 0.0) + count
    return sorted(rows, key=lambda b: -rows[b])[:3]


def table(groups: list[dict[str, Any]]) -> list[list[str]]:
    """The summary as Markdown rows."""

    def ratio(value: float | None, span: list[float] | None) -> str:
        if value is None or span is None:
            return "-"
        return f"{value:.2f} ({span[0]:.2f}-{span[1]:.2f})"

    return [
        [
            str(g["round"]),
            g["condition"],
            str(g["concurrency"]),
            g["side"],
            str(g["repeats"]),
            f"{g['plugin_tok_s']:.1f} / {g['plain_tok_s']:.1f}",
            ratio(g["tok_s_ratio"], g["tok_s_ratio_range"]),
            f"{g['plugin_itl_ms']:.2f} / {g['plain_itl_ms']:.2f}",
            ratio(g["itl_ratio"], g["itl_ratio_range"]),
            str(g["failed"]),
            "-" if g["padded_row_share"] is None else f"{100 * g['padded_row_share']:.1f}%",
            ", ".join(g["decode_buckets"]) or "-",
        ]
        for g in groups
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-qwen3")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--rounds", type=int, default=4, help="prompts = rounds x concurrency")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each level per side (medians reported)"
    )
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--sides", default=",".join(SIDES), help="plugin,plain")
    parser.add_argument(
        "--busy", action="store_true", help="then again with one busy process per core"
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="then the plugin again on buckets tuned from its own run's trace",
    )
    parser.add_argument("--omp-num-threads", type=int, help="OMP_NUM_THREADS for both servers")
    parser.add_argument("--plain-kv-bytes", type=int, default=256 << 20)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="one more vllm serve argument"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "load")
    args = parser.parse_args(argv)
    if args.model == ROOT / "models" / "tiny-qwen3":
        from build_tiny_model import build

        build("qwen3", args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    sides = args.sides.split(",")
    for side in sides:
        if side not in SIDES:
            parser.error(f"--sides: {side!r} is not one of {', '.join(SIDES)}")
    if args.tune and "plugin" not in sides:
        parser.error("--tune tunes on the plugin's run: keep plugin in --sides")
    trace = args.out.with_name(f"{args.out.name}-trace.jsonl")
    trace.unlink(missing_ok=True)
    recording = {"VLLM_NEURON_TRACE": str(trace)} if args.tune else {}
    with ExitStack() as plain_stack:
        plain = (
            [plain_stack.enter_context(serving(args, "plain", "plain"))] if "plain" in sides else []
        )
        with ExitStack() as stack:
            plugin = (
                [stack.enter_context(serving(args, "plugin", "plugin", env=recording))]
                if "plugin" in sides
                else []
            )
            rows = measure(args, plugin + plain, cores, 1)
        if args.tune:
            config = {"override_neuron_config": {"bucket_set": str(tune(args, trace))}}
            extra = ["--additional-config", json.dumps(config)]
            with serving(args, "plugin", "plugin-tuned", extra) as tuned:
                rows += measure(args, [tuned, *plain], cores, 2)
    meta = run_meta(
        "bench_load.py",
        argv,
        client="vllm bench serve (streamed completions, random prompts, ignore_eos)",
        workload=f"{args.input_len} prompt tokens, {args.output_len} output tokens",
        servers=" ".join(server_command(args, "plugin", 0)[1:]),
        load_average_at_start=load_before,
        cores=cores,
    )
    groups = summary(rows)
    write_results(
        args.out,
        meta,
        {"summary": groups, "rows": rows},
        [
            "round",
            "condition",
            "concurrency",
            "server",
            "repeats",
            "output tok/s, plugin / plain (medians)",
            "tok/s vs plain (median, range)",
            "ITL p50 ms, plugin / plain (medians)",
            "ITL p50 vs plain (median, range)",
            "failed",
            "padded decode rows",
            "decode buckets (most rows)",
        ],
        table(groups),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
