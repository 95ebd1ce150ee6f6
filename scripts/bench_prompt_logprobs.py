"""What a prompt-logprobs request costs beside a plain one: one context encoding of a
512- and a 2048-token prompt at Qwen3's real vocabulary (151,936; the one-layer
checkpoint scripts/build_tiny_model.py documents), with the backend in a runner process,
so every byte an answer moves crosses the process boundary as it crosses from a Neuron
device: the plain call returns a token (on-device sampling), the prompt-logprob call
also the top-k ids, values and ranks of every prompt position (k = --max-logprobs, 20 by
default: 8 (k + 1) + 8 bytes a position). "every position's logits" is what returning
the [positions, vocabulary] float32 logits instead would move (4 V bytes a position).

Times are the reference backend's on this host's CPU (median of the repeats, the
backend's own time and the call's wall time through the runner): they show the extra
graph work (every position's head, log-softmax and top-k), not Neuron's speed.

    python scripts/bench_prompt_logprobs.py --model models/qwen3-vocab151936 \
        --out bench-results/prompt-logprobs
writes prompt-logprobs.json and prompt-logprobs.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

PROMPTS = (512, 2048)


def settings_for(k: int):
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    longest = max(PROMPTS)
    limits = EngineLimits(
        max_model_len=longest + 16,
        max_num_seqs=1,
        block_size=None,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=longest + 16,
        dtype="float32",
        max_logprobs=k,
    )
    buckets = {
        "context_encoding_buckets": list(PROMPTS),
        "token_generation_buckets": [longest + 16],
    }
    settings = resolve_settings(
        limits,
        buckets,
        backend="reference",
        architecture="Qwen3ForCausalLM",
        prompt_logprobs=True,
    )
    return dataclasses.replace(settings, backend_python=sys.executable, skip_warmup=True)


def _answer_bytes(out) -> int:
    scored = 0 if out.prompt_logprobs is None else out.prompt_logprobs.nbytes()
    return int(out.tokens.nbytes + out.logits.numpy().nbytes + scored)


def measure(model: Path, k: int, repeats: int) -> list[dict]:
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.backends.runner.client import RunnerBackend
    from neuron_plugin.core.checkpoint import read_hf_config
    from neuron_plugin.core.inputs import context_encoding_inputs
    from neuron_plugin.core.prompt_logprobs import prompt_targets
    from neuron_plugin.core.sampling import SamplingInputs

    vocab = int(read_hf_config(model)["vocab_size"])
    settings = settings_for(k)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        backend = open_backend(settings, model, cache)
        try:
            for length in PROMPTS:
                prompt = np.arange(length, dtype=np.int64) % 1000 + 3
                plain = context_encoding_inputs(settings, prompt, 0, 0, None)
                scored = dataclasses.replace(
                    plain, prompt_targets=prompt_targets(prompt, 0, length, length)
                )
                for kind, inputs in (("plain", plain), ("prompt logprobs", scored)):
                    wall, own, moved = [], [], 0
                    for _ in range(repeats + 1):  # the first call warms the graph up
                        started = time.perf_counter()
                        out = backend.run(inputs, SamplingInputs.greedy(1))
                        wall.append(time.perf_counter() - started)
                        own.append(out.backend_s or 0.0)
                        moved = _answer_bytes(out)
                    rows.append(
                        {
                            "prompt": length,
                            "request": kind,
                            "backend_ms": 1000 * statistics.median(own[1:]),
                            "call_ms": 1000 * statistics.median(wall[1:]),
                            "bytes": moved,
                            "bytes_per_prompt_token": moved / length,
                        }
                    )
                full = 4 * vocab * length
                rows.append(
                    {
                        "prompt": length,
                        "request": "every position's logits",
                        "backend_ms": None,
                        "call_ms": None,
                        "bytes": full,
                        "bytes_per_prompt_token": full / length,
                    }
                )
        finally:
            if isinstance(backend, RunnerBackend):
                backend.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "qwen3-vocab151936")
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "prompt-logprobs")
    args = parser.parse_args(argv)

    rows = measure(args.model, args.max_logprobs, args.repeats)
    meta = run_meta(
        "bench_prompt_logprobs.py",
        argv,
        model=str(args.model),
        max_logprobs=args.max_logprobs,
        backend="reference (runner process)",
    )

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    table = [
        [
            str(r["prompt"]),
            r["request"],
            ms(r["backend_ms"]),
            ms(r["call_ms"]),
            f"{r['bytes']:,}",
            f"{r['bytes_per_prompt_token']:,.1f}",
        ]
        for r in rows
    ]
    write_results(
        args.out,
        meta,
        {"rows": rows},
        ["prompt", "request", "backend ms", "call ms", "bytes moved", "bytes / prompt token"],
        table,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
