"""`neuron-cache`: inspect and maintain a compile cache from the shell."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from compile_cache.cache import CompileCache
from compile_cache.errors import CacheError
from compile_cache.neuronx_cc import COMPILER_CACHE_ENV, compiler_cache_url
from compile_cache.settings import ENVIRONMENT_HELP, SIGNING_KEY_ENV, TRUSTED_KEYS_ENV
from compile_cache.signing import Trust, generate_key, key_id
from compile_cache.stores import open_store
from compile_cache.transfer import TransferReport, pull, push
from compile_cache.units import format_size, parse_duration, parse_size

EPILOG = f"""\
store URLs:
  /path/to/dir or file:///path/to/dir   a local directory
  s3://bucket/prefix                    S3 (entries read from S3 are cached locally)

{ENVIRONMENT_HELP}"""

# Neuron-config fields worth a column in `ls`, with their short labels.
_SHAPE_FIELDS = {
    "tp_degree": "tp",
    "batch_size": "bs",
    "seq_len": "seq",
    "max_context_length": "ctx",
}


def _argument(parse: Any) -> Any:
    """An argparse `type` that keeps `parse`'s own error message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return convert


def describe_model(manifest: Mapping[str, Any]) -> str:
    """'LlamaForCausalLM bfloat16 nxd' from a manifest."""
    model = manifest.get("model") or {}
    name = (model.get("architectures") or [None])[0] or model.get("model_type") or "?"
    return " ".join(str(p) for p in (name, manifest.get("dtype"), manifest.get("backend")) if p)


def describe_shapes(manifest: Mapping[str, Any], width: int = 60) -> str:
    """'tp2 bs4 context_encoding=128,256 ...' from a manifest, cut to `width`."""
    neuron = manifest.get("neuron") or {}
    parts = [f"{label}{neuron[name]}" for name, label in _SHAPE_FIELDS.items() if name in neuron]
    for name, grid in sorted((manifest.get("buckets") or {}).items()):
        values = grid if isinstance(grid, list) else [grid]
        parts.append(
            f"{name.removesuffix('_buckets')}="
            + ",".join("x".join(map(str, v)) if isinstance(v, list) else str(v) for v in values)
        )
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def cmd_ls(args: argparse.Namespace) -> int:
    infos = CompileCache(open_store(args.store)).list_entries()
    if args.json:
        _emit(args, [i.to_dict() for i in infos], "")
        return 0
    rows = [["KEY", "MODEL", "SHAPES", "SIZE", "CREATED", "LAST USED"]]
    rows += [
        [
            i.key,
            describe_model(i.record.manifest),
            describe_shapes(i.record.manifest),
            format_size(i.size),
            _when(i.record.created),
            _when(i.last_used),
        ]
        for i in infos
    ]
    _print_table(rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    cache = CompileCache(open_store(args.store))
    info = cache.entry_info(args.key)
    trust = cache.trust.describe(info.record)
    data = {
        **info.to_dict(),
        "trust": trust,
        "file_digests": {
            rel: {"sha256": f.sha256, "size": f.size}
            for rel, f in sorted(info.record.files.items())
        },
    }
    text = "\n".join(
        [
            f"key:        {info.key}",
            f"model:      {describe_model(info.record.manifest)}",
            f"size:       {format_size(info.size)} in {len(info.record.files)} files",
            f"created:    {_when(info.record.created)} by {info.record.created_by}",
            f"signature:  {trust}",
            f"last used:  {_when(info.last_used)}",
            "manifest:",
            json.dumps(info.record.manifest, indent=2, sort_keys=True),
            "files:",
            *(
                f"  {f.sha256[:16]}  {f.size:>12}  {rel}"
                for rel, f in sorted(info.record.files.items())
            ),
        ]
    )
    _emit(args, data, text)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    try:
        manifest = json.loads(Path(args.manifest).read_text())
    except (OSError, ValueError) as err:
        raise CacheError(
            f"cannot read manifest {args.manifest}: {err}; pass a JSON file "
            "such as one written by `neuron-plugin precompile --dry-run`"
        ) from err
    result = CompileCache(open_store(args.store)).explain(manifest, limit=args.limit)
    if result["hit"]:
        text = f"hit: entry {result['key']} in {result['store']}"
    else:
        lines = [f"miss: {result['reason']}"]
        if result["problem"]:
            lines.insert(0, f"entry {result['key']} is refused: {result['problem']}")
        lines += [
            f"  {n['key']}: differs in {', '.join(n['differs']) or 'nothing'}"
            for n in result["nearest"]
        ]
        text = "\n".join(lines)
    _emit(args, result, text)
    return 0 if result["hit"] else 1


def cmd_verify(args: argparse.Namespace) -> int:
    cache = CompileCache(open_store(args.store))
    results = cache.verify([cache.resolve_key(k) for k in args.keys] if args.keys else None)
    text = "\n".join(
        f"{r.key}  ok"
        if r.ok
        else f"{r.key}  FAILED: {r.problem}" + ("  (quarantined)" if r.quarantined else "")
        for r in results
    )
    _emit(args, [vars(r) for r in results], text or "no entries")
    return 0 if all(r.ok for r in results) else 1


def cmd_prune(args: argparse.Namespace) -> int:
    report = CompileCache(open_store(args.store)).prune(
        max_size_bytes=args.max_size, max_age_seconds=args.max_age, dry_run=args.dry_run
    )
    verb = "would remove" if args.dry_run else "removed"
    text = "\n".join(
        [
            *(f"{verb} {key}" for key in report.removed),
            *(f"swept {path}" for path in report.swept),
            *(f"purged quarantined {path}" for path in report.purged_quarantine),
            f"{verb} {len(report.removed)} entries ({format_size(report.freed_bytes)}),"
            f" kept {format_size(report.kept_bytes)}",
        ]
    )
    _emit(args, vars(report), text)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    cache = CompileCache(open_store(args.store))
    removed = {key: cache.remove(cache.resolve_key(key)) for key in args.keys}
    _emit(
        args,
        removed,
        "\n".join(f"removed {k}" if gone else f"no entry {k}" for k, gone in removed.items()),
    )
    return 0 if all(removed.values()) else 1


def _transfer(args: argparse.Namespace, report: TransferReport) -> int:
    text = "\n".join(
        [
            *(f"copied {k}" for k in report.copied),
            *(f"skipped {k} (already present)" for k in report.skipped),
            *(f"FAILED {k}: {why}" for k, why in report.failed.items()),
            f"{len(report.copied)} copied, {len(report.skipped)} skipped, "
            f"{len(report.failed)} failed",
        ]
    )
    _emit(args, vars(report), text)
    return 0 if not report.failed else 1


def cmd_push(args: argparse.Namespace) -> int:
    return _transfer(
        args, push(open_store(args.src), open_store(args.dst), args.key, progress=not args.json)
    )


def cmd_pull(args: argparse.Namespace) -> int:
    dst = open_store(args.dst) if args.dst else None
    return _transfer(args, pull(open_store(args.src), dst, args.key, progress=not args.json))


def cmd_compiler_cache(args: argparse.Namespace) -> int:
    url = compiler_cache_url(open_store(args.store))
    _emit(args, {COMPILER_CACHE_ENV: url}, url)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser()
    try:
        public = generate_key(path)
    except FileExistsError as err:
        raise CacheError(
            f"{path} exists; keygen never overwrites a key: choose another path or remove it"
        ) from err
    except OSError as err:
        raise CacheError(f"cannot write a key to {path}: {err}") from err
    data = {"private_key": str(path), "public_key": f"{path}.pub", "key_id": key_id(public)}
    _emit(
        args,
        data,
        "\n".join(
            [
                f"wrote the private key {path} (keep it on the compile hosts only) and the public "
                f"key {path}.pub (key id {data['key_id']})",
                f"compile hosts:  export {SIGNING_KEY_ENV}={path}",
                f"serving hosts:  export {TRUSTED_KEYS_ENV}={path}.pub",
            ]
        ),
    )
    return 0


def cmd_trust(args: argparse.Namespace) -> int:
    trust = Trust.from_env()
    trusted = trust.trusted_ids()
    data = {
        "signs_with": trust.signer_id,
        "trusted": trusted,
        "publishes_to_shared_stores": trust.publishes_to_shared_stores,
        "on_untrusted": trust.on_untrusted,
    }
    _emit(
        args,
        data,
        "\n".join(
            [
                f"signs with:      {data['signs_with']}"
                + (
                    ""
                    if trust.publishes_to_shared_stores
                    else f" (this user's own key: local stores only; set {SIGNING_KEY_ENV} "
                    "to publish to S3)"
                ),
                f"trusts:          {', '.join(trusted)}",
                f"untrusted entry: {trust.on_untrusted}",
            ]
        ),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument(
        "--store",
        metavar="URL",
        help="the store (default: $VLLM_NEURON_CACHE_URL, else the default local directory)",
    )
    parser = argparse.ArgumentParser(
        prog="neuron-cache",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect and maintain the compile cache of vLLM-on-Neuron artifacts. "
        "Entries are keyed by a digest of their manifest (model architecture, "
        "Neuron configuration, buckets, target, compiler versions and flags).",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, func: Any, help: str, parents: tuple = (common, store)) -> Any:
        sub = verbs.add_parser(
            name,
            help=help,
            description=help,
            epilog=EPILOG,
            parents=list(parents),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(func=func)
        return sub

    verb("ls", cmd_ls, "list entries: key, model, shapes, size, created, last used")
    verb("show", cmd_show, "show one entry's manifest and files").add_argument(
        "key", help="the key or a unique prefix of it"
    )
    explain = verb(
        "explain",
        cmd_explain,
        "tell whether a manifest has an entry and, if not, which stored entries "
        "are nearest and which fields differ (exit 1 on a miss)",
    )
    explain.add_argument(
        "manifest",
        help="a manifest JSON file (e.g. written by `neuron-plugin precompile --dry-run`)",
    )
    explain.add_argument("--limit", type=int, default=3, help="nearest entries to show")
    verb(
        "verify",
        cmd_verify,
        "check every entry's signature (or of KEYs) against the "
        "trusted keys and hash every file against its record; quarantine failures "
        "(exit 1 if any)",
    ).add_argument("keys", nargs="*", metavar="KEY")
    prune = verb(
        "prune",
        cmd_prune,
        "remove entries unused for longer than --max-age, "
        "then least recently used ones until the store fits --max-size; also "
        "removes leftovers of interrupted builds and quarantined entries",
    )
    prune.add_argument(
        "--max-size",
        type=_argument(parse_size),
        metavar="SIZE",
        help="e.g. 200G (binary units K, M, G, T)",
    )
    prune.add_argument(
        "--max-age",
        type=_argument(parse_duration),
        metavar="AGE",
        help="e.g. 30d (units s, m, h, d, w)",
    )
    prune.add_argument("--dry-run", action="store_true", help="only list what would go")
    verb("rm", cmd_rm, "remove entries (exit 1 if one did not exist)").add_argument(
        "keys", nargs="+", metavar="KEY"
    )
    push_cmd = verb(
        "push",
        cmd_push,
        "copy entries that DST lacks from SRC to DST, e.g. "
        "a build host's local store to s3://bucket/prefix",
        parents=(common,),
    )
    push_cmd.add_argument("src", metavar="SRC", help="source store URL")
    push_cmd.add_argument("dst", metavar="DST", help="destination store URL")
    pull_cmd = verb(
        "pull",
        cmd_pull,
        "copy entries from SRC (e.g. s3://bucket/prefix) into "
        "DST, by default this host's read cache ($VLLM_NEURON_CACHE_LOCAL_DIR, "
        "else the default local store), to pre-warm a host",
        parents=(common,),
    )
    pull_cmd.add_argument("src", metavar="SRC", help="source store URL")
    pull_cmd.add_argument("dst", metavar="DST", nargs="?", help="destination store URL")
    for sub in (push_cmd, pull_cmd):
        sub.add_argument(
            "--key", action="append", metavar="KEY", help="copy only this key (repeatable)"
        )
    verb(
        "keygen",
        cmd_keygen,
        "create an Ed25519 key pair for signing entries: PATH "
        "(private, for compile hosts) and PATH.pub (for every host's "
        f"{TRUSTED_KEYS_ENV})",
        parents=(common,),
    ).add_argument("path", metavar="PATH")
    verb(
        "trust",
        cmd_trust,
        "show the key this host signs with, the keys it trusts and "
        "its policy for untrusted entries",
        parents=(common,),
    )
    verb(
        "compiler-cache",
        cmd_compiler_cache,
        f"print the {COMPILER_CACHE_ENV} value that puts neuronx-cc's per-graph cache "
        "inside the store (a neuronx-cc/ folder or S3 prefix)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `neuron-cache` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CacheError as err:
        print(f"neuron-cache {args.verb}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
