"""What the backend runner's process boundary costs: an empty call's round trip, and a
decode call (the NxD contract arrays in, logits out) at batch 1 / 4 / 32, with the
backend in-process vs in a runner process (by default in the torch-2.9 environment that
scripts/setup-backend-env.sh builds).

Both backends run the same compiled reference graphs. "added" is what the boundary adds
to each call: the runner call's round trip less the backend's own time inside the runner (which it
reports with every reply), i.e. the JSON control message, the arena copies and two pipe
hops. The two processes' torch versions and thread pools differ, so the difference of
the in-process and runner medians also carries compute differences, and is shown apart.

    python scripts/bench_runner.py --out bench-results/runner
writes runner.json and runner.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

BATCHES = (1, 4, 32)
MAX_MODEL_LEN = 256


def settings_for(batch: int):
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    limits = EngineLimits(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=batch,
        block_size=None,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=MAX_MODEL_LEN,
        dtype="float32",
    )
    return resolve_settings(
        limits,
        {
            "token_generation_buckets": [MAX_MODEL_LEN],
            "context_encoding_buckets": [MAX_MODEL_LEN],
            "skip_warmup": True,
        },
        backend="reference",
        architecture="LlamaForCausalLM",
    )


def median_us(samples: list[float]) -> float:
    return round(1e6 * statistics.median(samples), 1)


def _timed(call, times: int) -> list[float]:
    """Seconds of each of `times` calls, after a few unmeasured ones."""
    for _ in range(5):
        call()
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def measure(model: Path, python: str, batch: int, calls: int, cache: str) -> dict:
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.backends.runner.client import RunnerBackend
    from neuron_plugin.core.inputs import token_generation_inputs

    settings = settings_for(batch)
    local = open_backend(settings, model, cache)
    remote = RunnerBackend(dataclasses.replace(settings, backend_python=python), model)
    try:
        remote.load(cache)
        inputs = token_generation_inputs(
            settings,
            np.arange(1, batch + 1),
            np.full(batch, MAX_MODEL_LEN // 2),
            np.arange(batch),
            None,
        )
        local_s = _timed(lambda: local.forward(inputs), calls)
        # Not interleaved with the in-process calls: torch's OpenMP workers spin on in
        # this process after each call and would slow the runner's next one.
        remote_s, added_s = [], []
        for _ in range(calls):
            remote_s += _timed(lambda: remote.forward(inputs), 1)
            added_s.append(remote_s[-1] - remote.last_backend_s)
        ping_s = _timed(remote.ping, calls)
        return {
            "batch": batch,
            "calls": calls,
            "in_process_us": median_us(local_s),
            "runner_us": median_us(remote_s),
            "added_us": median_us(added_s),
            "difference_of_medians_us": round(median_us(remote_s) - median_us(local_s), 1),
            "empty_call_us": median_us(ping_s),
            "runner": remote.handshake["versions"],
        }
    finally:
        remote.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        default=str(ROOT / ".venv-sdk" / "bin" / "python"),
        help="the runner's interpreter (default: .venv-sdk's)",
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "runner")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    model = build("llama", ROOT / "models" / "tiny-llama")
    with tempfile.TemporaryDirectory() as cache:
        rows = [measure(model, args.python, b, args.calls, cache) for b in BATCHES]
    v = rows[0]["runner"]
    meta = run_meta(
        "bench_runner.py",
        argv,
        runner=f"Python {v['python']}, torch {v['torch']}",
        vllm_side=f"Python {sys.version.split()[0]}",
    )
    table = [
        [
            str(r["batch"]),
            f"1x{MAX_MODEL_LEN}".replace("1x", f"{r['batch']}x"),
            f"{r['empty_call_us']:.0f}",
            f"{r['in_process_us']:.0f}",
            f"{r['runner_us']:.0f}",
            f"{r['added_us']:.0f}",
            f"{r['difference_of_medians_us']:.0f}",
        ]
        for r in rows
    ]
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "batch",
            "TKG bucket",
            "empty call us (runner)",
            "decode call us in-process",
            "decode call us runner",
            "added us per call (median)",
            "difference of medians us",
        ],
        table,
    )


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
    main()
