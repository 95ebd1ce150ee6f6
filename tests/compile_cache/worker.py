"""One compile-cache operation in its own process, for the multi-process tests.

    worker.py get_or_build STORE_URL MANIFEST_JSON COUNTER [--sleep S] [--hang MARKER]
        [--wait-timeout T] [--then-hang]   prints the CacheResult as JSON; with
        --then-hang it then sleeps until killed (a server using the entry)
    worker.py hold STORE_URL KEY MARKER   takes the key's lock, touches MARKER, sleeps
        until killed (a compile that hangs or dies while holding the lock)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cache_helpers import write_artifacts  # noqa: E402

from compile_cache.cache import CompileCache  # noqa: E402
from compile_cache.stores import open_store  # noqa: E402


def get_or_build(args: argparse.Namespace) -> None:
    manifest = json.loads(Path(args.manifest).read_text())

    def build(folder: Path) -> None:
        with open(args.counter, "a") as counter:
            counter.write(f"{os.getpid()}\n")
        if args.hang:
            (folder / "graphs").mkdir()
            (folder / "graphs" / "ctx_128.neff").write_bytes(b"half a compile")
            Path(args.hang).touch()
            time.sleep(120)
        time.sleep(args.sleep)
        write_artifacts(folder, tag=str(os.getpid()))

    result = CompileCache(open_store(args.store)).get_or_build(
        manifest, build, wait_timeout=args.wait_timeout)
    print(json.dumps({"path": str(result.path), "key": result.key, "hit": result.hit,
                      "reason": result.reason, "pid": os.getpid()}), flush=True)
    if args.then_hang:
        time.sleep(120)


def hold(args: argparse.Namespace) -> None:
    lock = open_store(args.store).lock(args.key)
    if not lock.try_acquire():
        sys.exit("lock is busy")
    Path(args.marker).touch()
    time.sleep(120)


def main() -> None:
    parser = argparse.ArgumentParser()
    verbs = parser.add_subparsers(dest="verb", required=True)
    sub = verbs.add_parser("get_or_build")
    sub.add_argument("store")
    sub.add_argument("manifest")
    sub.add_argument("counter")
    sub.add_argument("--sleep", type=float, default=0.0)
    sub.add_argument("--hang")
    sub.add_argument("--wait-timeout", type=float, default=60.0)
    sub.add_argument("--then-hang", action="store_true")
    sub.set_defaults(func=get_or_build)
    sub = verbs.add_parser("hold")
    sub.add_argument("store")
    sub.add_argument("key")
    sub.add_argument("marker")
    sub.set_defaults(func=hold)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
