"""`neuron-plugin precompile` and `neuron-plugin measure-buckets`: the serving-free work a
fleet does ahead of time.

precompile: resolve a configuration exactly as `vllm serve MODEL [flags]` would, then
compile every bucket's graph into the compile cache (a progress bar names the bucket
being compiled) without starting a server; `vllm serve` with the same flags then starts
warm, on this host or on any host sharing the store. `--dry-run` writes the cache
manifest instead (for `neuron-cache explain`).

measure-buckets: load the same configuration's graphs (compiling on a miss) and time
each bucket's forward, writing the cost tables `neuron-buckets tune --cost FILE` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compile_cache.settings import SIGNING_KEY_ENV
from neuron_plugin import BACKEND_ENV, BACKENDS
from neuron_plugin.tools.serve_args import add_serve_command, engine_config_from_serve_args

if TYPE_CHECKING:  # backends import torch: keep `neuron-plugin --help` and doctor fast
    from neuron_plugin.backends.base import Progress


def _common(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"backend to compile for (default: ${BACKEND_ENV}, else what "
        f"`vllm serve` with these flags would use, else nxd)",
    )
    group.add_argument(
        "--cache",
        metavar="URL",
        help="compile-cache store: a path, file:///path or s3://bucket/prefix "
        "(default: $VLLM_NEURON_CACHE_URL, else "
        "~/.cache/vllm-neuron/compile-cache)",
    )


def _precompile_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("precompile")
    _common(group)
    group.add_argument(
        "--dry-run",
        metavar="MANIFEST.json",
        type=Path,
        help="write the cache manifest of this configuration and stop "
        "(then: neuron-cache explain MANIFEST.json)",
    )


def _measure_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("measure-buckets")
    _common(group)
    group.add_argument(
        "--output",
        "-o",
        type=Path,
        required=True,
        metavar="PREFIX",
        help="writes PREFIX-<phase>.yaml cost tables",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="timed calls per bucket; the median is kept (default 10)",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for name, options, runner, text in (
        (
            "precompile",
            _precompile_options,
            run_precompile,
            "compile every bucket of a `vllm serve` configuration into the compile cache",
        ),
        (
            "measure-buckets",
            _measure_options,
            run_measure,
            "time every compiled bucket and write cost tables for `neuron-buckets tune`",
        ),
    ):
        add_serve_command(subparsers, name, runner, options, text)


def _resolve(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, Any]:
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    options, vllm_config = engine_config_from_serve_args(
        args.argv, args.own_options, prog=args.prog
    )
    return options, vllm_config, settings_from_vllm_config(vllm_config)


def run_precompile(args: argparse.Namespace) -> int:
    from neuron_plugin.backends.loader import compile_configuration, configuration_manifest

    options, vllm_config, settings = _resolve(args)
    model = vllm_config.model_config.model
    if options.dry_run:
        options.dry_run.write_text(
            json.dumps(configuration_manifest(settings, model), indent=2, sort_keys=True)
        )
        print(f"wrote the cache manifest to {options.dry_run}")
        return 0
    with bucket_bar(settings.graph_count()) as progress:
        result = compile_configuration(settings, model, options.cache, progress)
    if not result.in_store:
        # A precompile exists to fill the store the serving hosts read: fail loudly.
        print(
            f"{settings.graph_count()} graphs are only in this host's read cache, not in "
            f"the store the serving hosts read: key {result.key} ({result.reason}). A "
            f"host publishes to a shared store only with {SIGNING_KEY_ENV} set to the "
            f"fleet's signing key (`neuron-cache keygen`); set it, or run again once the "
            f"store is reachable.",
            file=sys.stderr,
        )
        return 1
    state = "already in the cache" if result.hit else "compiled and published"
    print(f"{settings.graph_count()} graphs {state}: key {result.key} ({result.reason})")
    return 0


@contextlib.contextmanager
def bucket_bar(total: int) -> Iterator[Progress]:
    """A progress callback whose bar names the bucket just compiled; the bar appears
    with the first compiled graph, so a cache hit shows none."""
    bar = None

    def compiled(name: str) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="compiling buckets", unit="graph")
        bar.update(1)
        bar.set_postfix(bucket=name)

    try:
        yield compiled
    finally:
        if bar is not None:
            bar.close()


def run_measure(args: argparse.Namespace) -> int:
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.tools.measure import prepare_output, time_buckets, write_cost_tables

    options, vllm_config, settings = _resolve(args)
    prepare_output(options.output)
    backend = open_backend(settings, vllm_config.model_config.model, options.cache)
    try:
        timings = time_buckets(backend, repeats=options.repeats)
    finally:
        close = getattr(backend, "close", None)  # a runner process has one
        if close is not None:
            close()
    source = (
        f"neuron-plugin measure-buckets, {settings.backend} backend, "
        f"{vllm_config.model_config.model}"
    )
    for path in write_cost_tables(timings, options.output, source, options.repeats):
        print(path)
    return 0
