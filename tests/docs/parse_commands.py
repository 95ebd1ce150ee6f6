"""Parse documented commands with the tools they name, without running them. A script of
its own (tests/docs/test_commands.py runs it with VLLM_NEURON_BACKEND=reference, so
vLLM's parser carries this platform's flags, e.g. --device): reads a JSON list of argv
lists on stdin, prints a JSON list with, per command, null when it parses or the tool's
own error message.

- `vllm serve|bench ...`: vLLM's own CLI subcommand parsers (`vllm.entrypoints.cli`);
- `neuron-plugin`, `neuron-buckets`, `neuron-cache`: the plugin's parsers; a verb taking
  `vllm serve` flags (explain-config, precompile, quantize, validate, ...) has them
  parsed by vLLM's engine-argument parser with the verb's own options;
- `python scripts/NAME.py ...`: the script's own argparse parser, stopped as soon as it
  has parsed (the script never runs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Parsed(Exception):
    """Raised by the patched parse_args once a script's arguments parsed."""


def _vllm(argv: list[str]) -> None:
    import vllm.entrypoints.cli.benchmark.main
    import vllm.entrypoints.cli.serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    for module in (vllm.entrypoints.cli.serve, vllm.entrypoints.cli.benchmark.main):
        for command in module.cmd_init():
            command.subparser_init(subparsers)
    parser.parse_args(argv)


def _neuron_plugin(argv: list[str]) -> None:
    from neuron_plugin.tools.cli import build_parser
    from neuron_plugin.tools.serve_args import serve_parser

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "argv"):
        serve_parser(args.own_options, args.prog).parse_args(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")


def _script(argv: list[str]) -> None:
    path = ROOT / argv[0]
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        original(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    sys.argv = [str(path), *argv[1:]]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise SystemExit(f"{argv[0]} finished without parsing its arguments with argparse")


def _tool(argv: list[str]) -> None:
    program = Path(argv[0]).name
    if program == "vllm":
        return _vllm(argv[1:])
    if program == "neuron-plugin":
        return _neuron_plugin(argv[1:])
    if program == "neuron-buckets":
        from bucketing.cli import build_parser

        build_parser().parse_args(argv[1:])
        return None
    if program == "neuron-cache":
        from compile_cache.cli import build_parser as cache_parser

        cache_parser().parse_args(argv[1:])
        return None
    if program.startswith("python"):
        return _script(argv[1:])
    raise SystemExit(f"no parser for {program}")


def check(argv: list[str]) -> str | None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            _tool(argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        message = stderr.getvalue().strip().splitlines()
        return message[-1] if message else str(exc.code)
    return None


if __name__ == "__main__":
    print(json.dumps([check(argv) for argv in json.load(sys.stdin)]))
