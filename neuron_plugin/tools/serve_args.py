"""`vllm serve`'s flags for the plugin's own commands: the same parser, the same config.

explain-config, precompile, measure-buckets, quantize and validate take
`MODEL [vllm serve flags]` plus a few options of their own, and must resolve exactly the
configuration `vllm serve` would, so they build it with vLLM's own argument parser and
EngineArgs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from neuron_plugin import BACKEND_ENV, choose_backend, neuron_devices

OwnOptions = Callable[[argparse.ArgumentParser], None]


def add_serve_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace], int],
    own_options: OwnOptions,
    help_text: str,
) -> None:
    """Register `neuron-plugin NAME MODEL [vllm serve flags]`: the command's arguments
    stay unparsed (`argv`) until `engine_args_from_serve_args` reads them with vLLM's
    own parser, which also answers --help."""
    parser = subparsers.add_parser(
        name, add_help=False, help=help_text, description="Takes the same flags as `vllm serve`."
    )
    parser.set_defaults(run=run, argv=[], own_options=own_options, prog=f"neuron-plugin {name}")


def serve_parser(own_options: OwnOptions, prog: str) -> Any:
    """vLLM's own parser of `vllm serve`'s engine flags, with the command's options."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog=prog, description="Resolve a configuration as `vllm serve MODEL [flags]` would."
    )
    parser.add_argument("model_tag", nargs="?", help="the model, as for `vllm serve`")
    own_options(parser)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def engine_args_from_serve_args(
    argv: Sequence[str], own_options: OwnOptions, *, prog: str
) -> tuple[argparse.Namespace, Any]:
    """(parsed options, vLLM's AsyncEngineArgs). `own_options` adds the command's
    options, which must include `--backend` (default None): it is read first, because
    vLLM resolves its platform (and so the backend) while parsing. Without it the backend
    is chosen as `vllm serve` with these flags would choose it, falling back to nxd (a
    build host without devices still compiles for Neuron)."""
    pre = argparse.ArgumentParser(add_help=False)
    own_options(pre)
    known, _ = pre.parse_known_args(argv)
    os.environ[BACKEND_ENV] = (
        known.backend or choose_backend(os.environ, argv, neuron_devices()) or "nxd"
    )

    parser = serve_parser(own_options, prog)
    options = parser.parse_args(list(argv))
    if options.model_tag:
        options.model = options.model_tag
    from vllm.engine.arg_utils import AsyncEngineArgs

    return options, AsyncEngineArgs.from_cli_args(options)


def engine_config_from_serve_args(
    argv: Sequence[str], own_options: OwnOptions, *, prog: str
) -> tuple[argparse.Namespace, Any]:
    """(parsed options, VllmConfig): `engine_args_from_serve_args`'s configuration."""
    options, engine_args = engine_args_from_serve_args(argv, own_options, prog=prog)
    return options, engine_args.create_engine_config()
