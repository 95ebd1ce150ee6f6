"""Decode at the device's pace: decode throughput and inter-token latency at batch 1 / 8 /
32 with the backend in a runner process (by default in the torch-2.9 environment that
scripts/setup-backend-env.sh builds), vLLM's async scheduling on vs off, device vs host
sampling, on a one-layer Qwen3-shaped checkpoint with Qwen3's 151,936-token vocabulary.

Drives the real engine (`vllm.LLM`, its engine core in this process so the worker is
reachable) and reads three clocks per configuration and batch, once every request of
the batch is decoding:
- inter-token latency: the wall time between consecutive engine steps that deliver the
  batch's tokens to the caller (the step time a client sees); tokens/s is the batch's
  tokens over the decode phase;
- the backend's own time per decode call, as the runner reports it with every reply
  (`backend_s`: the forward and the device sampler, not the process boundary);
- step time / backend time: 1.00 means the host's work is entirely hidden.

Sampling: *device*: every request T 0.7, top-k 50, top-p 0.9 (the device sampler serves
it; a token per row crosses the seam); *host rows*: the same requests asking for
logprobs (each row's logits cross the seam and vLLM's Sampler serves it, on-device
sampling still on); *host config*: on-device sampling off (every row's logits, async
scheduling forced off by the platform).

    python scripts/bench_decode_pace.py --out bench-results/decode_pace
writes decode_pace.json and decode_pace.md.
"""

from __future__ import annotations

import argparse
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

BATCHES = (1, 8, 32)
PROMPT = 16
MAX_MODEL_LEN = 128
# (sampling, async scheduling): host config runs synchronous steps (the platform's rule).
CONFIGS = (
    ("device", True),
    ("device", False),
    ("host rows", True),
    ("host rows", False),
    ("host config", False),
)


class DecodeClock:
    """Observer on the model runner: the backend's own time of each decode call."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.backend_s: list[tuple[int, float]] = []  # (real rows, seconds)

    def on_backend_call(self, inputs, forward_s: float, host_s: float, accepted: int = 0) -> None:
        from neuron_plugin.core.inputs import TOKEN_GENERATION

        if inputs.phase == TOKEN_GENERATION:
            self.backend_s.append((inputs.num_real, self.backend.last_backend_s))

    def on_vision_call(self, bucket: int, patches: int, forward_s: float) -> None:
        pass  # text models only

    def on_step(self, host_s: float) -> None:
        pass

    def on_request_finished(self, request) -> None:
        pass


def make_llm(model: Path, sampling: str, async_on: bool, python: str):
    from vllm import LLM

    override: dict[str, Any] = {
        "context_encoding_buckets": [PROMPT * 2],
        "token_generation_buckets": [MAX_MODEL_LEN],
        "token_generation_batches": list(BATCHES),
    }
    if sampling == "host config":
        override["on_device_sampling_config"] = None
    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(BATCHES),
        seed=0,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        async_scheduling=async_on,
        gpu_memory_utilization=0.1,
        additional_config={"override_neuron_config": override, "backend_python": python},
    )


def params(sampling: str, max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=1 if sampling == "host rows" else None,
    )


def decode(llm, clock: DecodeClock, sampling: str, batch: int, tokens: int) -> dict:
    """`batch` requests at once; the decode phase's step times and backend times."""
    engine = llm.llm_engine
    rng = np.random.default_rng(batch)
    for i in range(batch):
        prompt = rng.integers(5, 5000, PROMPT).tolist()
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params(sampling, tokens))
    clock.backend_s.clear()
    produced: dict[str, int] = {}
    stamps: list[tuple[float, int]] = []  # (when, tokens delivered) once all decode
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        new = 0
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            new += count - produced.get(out.request_id, 0)
            produced[out.request_id] = count
        if new and len(produced) == batch and min(produced.values()) >= 2:
            stamps.append((now, new))
    steps = np.diff([t for t, _ in stamps])
    decode_s = stamps[-1][0] - stamps[0][0]
    backend = [s for rows, s in clock.backend_s if rows == batch][2:]
    itl = 1e3 * float(np.median(steps))
    forward = 1e3 * statistics.median(backend)
    return {
        "tokens_per_s": sum(n for _, n in stamps[1:]) / decode_s,
        "itl_ms_p50": itl,
        "itl_ms_p90": 1e3 * float(np.percentile(steps, 90)),
        "backend_ms_p50": forward,
        "step_over_backend": itl / forward,
        "decode_steps": len(steps),
    }


def measure(model: Path, sampling: str, async_on: bool, python: str, tokens: int) -> list[dict]:
    from neuron_plugin.serving.model_runner import NeuronModelRunner

    llm = make_llm(model, sampling, async_on, python)
    try:
        (runner,) = llm.collective_rpc(lambda worker: worker.model_runner)
        if not isinstance(runner, NeuronModelRunner):
            raise RuntimeError("the engine core must run in this process")
        clock = DecodeClock(runner.backend)
        runner.observers = (*runner.observers, clock)
        decode(llm, clock, sampling, 4, 8)  # warm-up
        rows = []
        for batch in BATCHES:
            row = decode(llm, clock, sampling, batch, tokens)
            row.update(
                batch=batch,
                sampling=sampling,
                async_scheduling=bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        llm.llm_engine.engine_core.shutdown()


def table_rows(rows: list[dict]) -> list[list[str]]:
    by_key = {(r["batch"], r["sampling"], r["async_scheduling"]): r for r in rows}
    lines = []
    for batch in BATCHES:
        for sampling, async_on in CONFIGS:
            row = by_key.get((batch, sampling, async_on))
            if row is None:
                continue
            off = by_key.get((batch, sampling, False))
            ratio = row["tokens_per_s"] / off["tokens_per_s"] if async_on and off else None
            lines.append(
                [
                    str(batch),
                    sampling,
                    "on" if async_on else "off",
                    f"{row['tokens_per_s']:.1f}",
                    f"{row['itl_ms_p50']:.1f} / {row['itl_ms_p90']:.1f}",
                    f"{row['backend_ms_p50']:.1f}",
                    f"{row['step_over_backend']:.3f}",
                    "-" if ratio is None else f"{ratio:.2f}",
                ]
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "qwen3-vocab151936")
    parser.add_argument(
        "--python",
        default=str(ROOT / ".venv-sdk" / "bin" / "python"),
        help="the runner's interpreter (default: .venv-sdk's)",
    )
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "decode_pace")
    args = parser.parse_args(argv)
    from build_tiny_model import QWEN3_VOCAB, build

    model = build("qwen3", args.model, layers=1, model_vocab=QWEN3_VOCAB)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["VLLM_NEURON_CACHE_URL"] = cache
        rows = [
            row
            for sampling, async_on in CONFIGS
            for row in measure(model, sampling, async_on, args.python, args.tokens)
        ]
    meta = run_meta(
        "bench_decode_pace.py", argv, vocab=QWEN3_VOCAB, prompt_tokens=PROMPT, tokens=args.tokens
    )
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "batch",
            "sampling",
            "async scheduling",
            "tokens/s",
            "inter-token ms p50 / p90",
            "backend forward ms p50",
            "step / backend",
            "tokens/s on / off",
        ],
        table_rows(rows),
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
    # The engine core in this process, so the bench can observe the worker's backend.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
