"""What moving a request's KV blocks out of and into NxD's state tensors costs
(prefill/decode disaggregation, backends/nxd/kv_state.py), on the NxDI test double's
terms: its stand-in device tensors (tests/plugin/fake_nxdi, _device.DeviceTensor) allow
what NxD's device tensors allow (views, contiguous host<->device copies) and refuse
gathers, scatters and device-to-device copies, so the plugin's read and write run as
they would on a NeuronCore, each copy here a host memcpy. The figures: per read and per
write of N blocks, the host<->device copies, their bytes, and the time per block, at
two cache sizes (a move must cost in the blocks moved, never in the cache's size), the
blocks consecutive (one run) or every other block (N runs). A device adds a fixed cost
per copy (DMA set-up, the runtime call) that this host cannot show.

    python scripts/bench_kv_blocks.py --out bench-results/kv_blocks
writes kv_blocks.json and kv_blocks.md. The default geometry is Llama-3.1-8B's at TP 2
in bfloat16 (32 layers, 8 KV heads of 128, block 32: 4 MiB a block).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "plugin" / "fake_nxdi"))

from bench_report import run_meta, write_results  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def settings_for(args: argparse.Namespace, cache_blocks: int) -> Any:
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    max_model_len = args.block_size * max(args.blocks)
    limits = EngineLimits(
        max_model_len=max_model_len,
        max_num_seqs=1,
        block_size=args.block_size,
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max_model_len,
        dtype=args.dtype,
        tp_degree=args.tp,
        num_gpu_blocks_override=cache_blocks,
    )
    return resolve_settings(limits, {}, backend="nxd", architecture="LlamaForCausalLM")


def stand_in_model(args: argparse.Namespace, blocks: int, device: bool) -> Any:
    """An NxDI application as NxDKVState reaches it: per rank, a K and a V state tensor
    per layer in NxDI's prefix-caching shape (reserved block +1), on the stand-in device
    (`device`) or plain host tensors (as NxDI's CPU mode holds them)."""
    from neuronx_distributed_inference._device import on_device

    heads = args.kv_heads // args.tp
    shape = (blocks + 1, args.block_size, heads, args.head_dim)
    state = [
        {
            f"kv_mgr.past_key_values.{i}": (on_device if device else torch.Tensor.contiguous)(
                torch.randn(shape, dtype=torch.float32).to(DTYPES[args.dtype])
            )
            for i in range(2 * args.layers)
        }
        for _ in range(args.tp)
    ]
    nxd_model = SimpleNamespace(state=state)
    return SimpleNamespace(
        neuron_config=SimpleNamespace(is_prefix_caching=True, kv_quant_config=None),
        context_encoding_model=SimpleNamespace(model=SimpleNamespace(nxd_model=nxd_model)),
    )


def timed(call: Any, repeat: int) -> float:
    """Median seconds of `call` over `repeat` runs after one warm-up."""
    call()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(args: argparse.Namespace, cache_blocks: int) -> list[dict[str, Any]]:
    from neuronx_distributed_inference._device import TRANSFERS

    from neuron_plugin.backends.nxd.kv_state import NxDKVState

    settings = settings_for(args, cache_blocks)
    states = {
        device: NxDKVState(
            stand_in_model(args, settings.num_blocks, device), settings, False, "nxd"
        )
        for device in (True, False)
    }
    block_bytes = states[True].geometry().block_bytes
    rows = []
    for count in args.blocks:
        for layout in ("consecutive", "every other"):
            step = 1 if layout == "consecutive" else 2
            ids = np.arange(1, 1 + step * count, step, dtype=np.int64)
            TRANSFERS.clear()
            kv = states[True].read(ids)
            row = {
                "cache_blocks": settings.num_blocks,
                "blocks": count,
                "layout": layout,
                "copies": len(TRANSFERS),
                "bytes": sum(n for _, n in TRANSFERS),
                "block_bytes": block_bytes,
            }
            for device, state in states.items():
                where = "stand_in" if device else "host"
                read_s = timed(lambda s=state, i=ids: s.read(i), args.repeat)
                write_s = timed(lambda s=state, i=ids, k=kv: s.write(i, k), args.repeat)
                row[f"{where}_read_us_per_block"] = 1e6 * read_s / count
                row[f"{where}_write_us_per_block"] = 1e6 * write_s / count
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--cache-blocks", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "kv_blocks")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for blocks in args.cache_blocks for row in measure(args, blocks)]
    meta = run_meta(
        "bench_kv_blocks.py",
        argv,
        geometry=f"{args.layers} layers, {args.kv_heads} KV heads of {args.head_dim}, "
        f"block {args.block_size}, TP {args.tp}, {args.dtype}",
        torch=torch.__version__,
    )
    table = [
        [
            str(r["cache_blocks"]),
            str(r["blocks"]),
            r["layout"],
            str(r["copies"]),
            f"{r['bytes'] / 2**20:.0f}",
            f"{r['host_read_us_per_block']:.0f} / {r['host_write_us_per_block']:.0f}",
            f"{r['stand_in_read_us_per_block']:.0f} / {r['stand_in_write_us_per_block']:.0f}",
        ]
        for r in rows
    ]
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "cache blocks",
            "blocks moved",
            "block ids",
            "host<->device copies (read; write the same)",
            "MiB each way",
            "host tensors: read / write µs per block",
            "stand-in device tensors: read / write µs per block",
        ],
        table,
    )


if __name__ == "__main__":
    main()
