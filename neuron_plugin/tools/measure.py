"""Measure each compiled bucket's forward time on the current backend and write the
cost tables `neuron-buckets tune --cost` accepts.

Graphs have static shapes, so a padding-only call costs what a real call of that bucket
costs; padding writes go to scratch, so measuring never disturbs a KV cache. The same
command measures the reference backend here and NxD graphs on an inf2 host.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bucketing.cost import dump_cost_table
from neuron_plugin.backends.base import LoadedBackend, graph_specs, run_graph_once
from neuron_plugin.core.inputs import CONTEXT_ENCODING


def table_phase(phase: str, shape: tuple[int, ...]) -> str:
    """The cost-table phase name: (active, prefix) context encoding is its own table."""
    if phase == CONTEXT_ENCODING and len(shape) == 2:
        return "prefix_context_encoding"
    return phase


def time_buckets(
    backend: LoadedBackend, repeats: int = 10, warmup: int = 2
) -> dict[str, list[tuple[tuple[int, ...], float]]]:
    """Median milliseconds per graph, grouped by cost-table phase. A token-generation
    shape with a separate logits graph is timed on its tokens-only graph, the one a step
    without host-sampled rows runs, and a context-encoding shape on its usual graph, not
    its prompt-logprob twin (the cost tables price the bucket grid)."""
    settings = backend.settings
    timings: dict[str, list[tuple[tuple[int, ...], float]]] = {}
    for graph in graph_specs(settings):
        if graph.logits or graph.prompt_logprobs:
            continue
        for _ in range(warmup):
            run_graph_once(backend, graph)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run_graph_once(backend, graph)
            samples.append(1000 * (time.perf_counter() - start))
        timings.setdefault(table_phase(graph.phase, graph.shape), []).append(
            (graph.shape, statistics.median(samples))
        )
    return timings


def prepare_output(prefix: Path) -> None:
    """Create the folder of ``-o PREFIX`` before anything is compiled or timed, so a bad
    path fails in seconds instead of after every bucket has been measured."""
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--output {prefix}: cannot create the folder {prefix.parent} "
            f"({exc.strerror}); pass -o PREFIX inside a writable folder"
        ) from None


def write_cost_tables(
    timings: dict[str, list[tuple[tuple[int, ...], float]]], prefix: Path, source: str, repeats: int
) -> list[Path]:
    """One table per phase: PREFIX-context_encoding.yaml, PREFIX-token_generation.yaml."""
    written = []
    for phase, rows in sorted(timings.items()):
        path = prefix.with_name(f"{prefix.name}-{phase}.yaml")
        written.append(
            dump_cost_table(path, phase=phase, timings=rows, source=source, samples=repeats)
        )
    return written
