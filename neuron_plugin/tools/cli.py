"""`neuron-plugin VERB ...`: one subcommand per verb, each verb's logic in its own module
(`explain-config` in explain.py, `doctor` in doctor.py, `precompile` and
`measure-buckets` in precompile.py, `quantize` in quantize.py, `validate` in
validate.py, `models` in models.py). A verb module provides
`add_parser(subparsers)`, which registers its arguments and `run(args) -> exit code`.
A verb whose defaults include `argv` receives every argument after its name unparsed
(explain-config hands them to vLLM's own parser)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from neuron_plugin.tools import doctor, explain, models, precompile, quantize, validate

VERB_MODULES = (explain, doctor, models, precompile, quantize, validate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-plugin", description="Tools of the vLLM Neuron platform plugin."
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for module in VERB_MODULES:
        module.add_parser(verbs)
    return parser


def error_message(exc: Exception) -> str:
    """The message of a configuration error; vLLM wraps the platform's errors in a
    pydantic ValidationError whose own text adds noise around it."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "argv"):  # only verbs that take another tool's flags
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    else:
        args.argv = extra
    from compile_cache.errors import CacheError

    try:
        return args.run(args)
    except (ValueError, CacheError) as exc:  # they name the setting or store and the fix
        print(f"neuron-plugin {args.verb}: error: {error_message(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
