"""The cost of serving host-sampled rows on vLLM's PyTorch paths on every build.

`serving.host_sampling.HostRowsSampler` replaces the two places where vLLM's Sampler on a
CPU platform calls the CPU build's compiled ops (greedy: `torch.ops._C.greedy_argmax`;
top-k/top-p draws: `TopKTopPSampler.forward_cpu`, `torch.ops._C.fused_gumbel_argmax`),
which the `vllm` wheel a Neuron host installs does not have. This times both on the
same logits at Qwen3's vocabulary (151,936), in vLLM's CPU build (the test environment;
the only one with the compiled ops), and prints medians in one run:

    python scripts/bench_host_sampler.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

VOCAB = 151_936
BATCHES = (1, 8, 32)


def fresh(sampler: Callable[..., object], logits: torch.Tensor, *args: object) -> object:
    """A draw on a copy (samplers may modify the logits in place)."""
    return sampler(logits.clone(), *args)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from neuron_plugin.serving.host_sampling import HostRowsSampler

    CpuPlatform.import_kernels()  # the CPU build's _C, for its fused ops
    compiled = TopKTopPSampler()
    host = HostRowsSampler("raw_logprobs")
    torch.manual_seed(0)
    print(f"vocab {VOCAB:,}, median of {args.repeats} (ms)")
    print("| batch | row kind | CPU build's compiled op | PyTorch path (all builds) | ratio |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        logits = torch.randn(batch, VOCAB) * 3
        k = torch.full((batch,), 50, dtype=torch.int64)
        p = torch.full((batch,), 0.9)
        seeded = {i: torch.Generator().manual_seed(i) for i in range(batch)}
        greedy, draw = torch.ops._C.greedy_argmax, compiled.forward_cpu
        cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "greedy": (partial(greedy, logits), partial(host.greedy_sample, logits)),
            "top-k 50, top-p 0.9": (
                partial(fresh, draw, logits, {}, k, p),
                partial(fresh, host.topk_topp_sampler, logits, {}, k, p),
            ),
            "T only, seeded": (
                partial(fresh, draw, logits, seeded, None, None),
                partial(fresh, host.topk_topp_sampler, logits, seeded, None, None),
            ),
        }
        for kind, (op, native) in cases.items():
            a, b = median_ms(op, args.repeats), median_ms(native, args.repeats)
            print(f"| {batch} | {kind} | {a:.2f} | {b:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
