"""What a decode server's checks of a KV payload cost per block: the HMAC-SHA256 tag over
its bytes (kv_transfer.auth) and the refusal of NaN/Inf (kv_transfer.payload), each on
the host, at a real model's geometry (default Llama-3.1-8B: 32 layers, 8 KV heads of
128, blocks of 32 tokens, bfloat16: 4 MiB a block), beside what reading the payload file
costs.

    python scripts/bench_kv_checks.py [--layers 32 --kv-heads 8 --head-dim 128
        --block-size 32 --dtype bfloat16 --blocks 16 --repeats 5]

Prints one JSON line: per block, microseconds (median of the repeats) and GB/s for the
tag, the finite check and a payload read from /dev/shm (written once first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.kv_transfer import auth, payload
from neuron_plugin.kv_transfer.params import new_key


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = parser.parse_args(argv)

    geometry = KVGeometry(
        args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype, "bench"
    )
    kv = torch.randn(geometry.shape(args.blocks)).to(geometry.torch_dtype)
    tokens = list(range(args.blocks * args.block_size))
    token_ids = torch.tensor(tokens, dtype=torch.int64)
    secret = b"k" * 32
    metadata = {"format": payload.FORMAT, "model": "m" * 64}
    tag_s = _median_s(lambda: auth.tag(secret, "0" * 32, metadata, [token_ids, kv]), args.repeats)
    finite_s = _median_s(lambda: payload.all_finite(kv), args.repeats)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        key = new_key()
        scope = payload.RequestScope()
        payload.write_payload(folder, key, kv, tokens, "m" * 64, geometry, secret, scope=scope)
        read_s = _median_s(
            lambda: payload.read_payload(
                folder, key, "m" * 64, geometry, tokens, args.blocks, secret, scope=scope
            ),
            args.repeats,
        )
    block = geometry.block_bytes
    result = {
        "geometry": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": args.dtype,
            "block_bytes": block,
            "blocks": args.blocks,
        },
        "torch_threads": torch.get_num_threads(),
        **{
            f"{name}_us_per_block": round(seconds / args.blocks * 1e6, 1)
            for name, seconds in (("hmac", tag_s), ("finite", finite_s), ("read", read_s))
        },
        **{
            f"{name}_gb_per_s": round(block * args.blocks / seconds / 1e9, 2)
            for name, seconds in (("hmac", tag_s), ("finite", finite_s), ("read", read_s))
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
