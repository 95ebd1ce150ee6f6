"""What moving a request's KV blocks out of and into NxD's state tensors costs
(prefill/decode disaggregation, backends/nxd/kv_state.py), per tensor-parallel degree,
on the NxDI test double's terms: its stand-in device tensors (tests/plugin/fake_nxdi,
_device.DeviceTensor) allow what NxD's device tensors allow (views, contiguous
host<->device copies) and refuse gathers, scatters and device-to-device copies, so the
plugin's read and write run as they would on NeuronCores, each copy here a host memcpy.
Each rank holds the KV heads NxDI's GQA sharding gives it (core.kv_heads: replicas where
TP exceeds the KV heads, padding heads where TP is no multiple of them).

The figures, per TP degree: the model's KV bytes per token beside the payload's, the
bytes copied device -> host by a read and host -> device by a write per token, the
copies each makes and the longest run of them one thread issues one after another (the
ranks' copies run side by side), and the time per block on the stand-in (a device adds
a fixed cost per copy, DMA set-up and the runtime call, that this host cannot show).

    python scripts/bench_kv_blocks.py --out bench-results/kv_blocks
writes kv_blocks.json and kv_blocks.md. The default geometry is Llama-3.1-8B's in
bfloat16 (32 layers, 32 attention heads, 8 KV heads of 128, block 32: 128 KiB of KV a
token), 8 consecutive blocks moved out of a 64-block cache, at TP 1, 2, 4, 8, 12, 16, 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
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


def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_size": args.heads * args.head_dim,
    }


def settings_for(args: argparse.Namespace, tp: int) -> Any:
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    max_model_len = args.block_size * args.blocks
    limits = EngineLimits(
        max_model_len=max_model_len,
        max_num_seqs=1,
        block_size=args.block_size,
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max_model_len,
        dtype=args.dtype,
        tp_degree=tp,
        num_gpu_blocks_override=args.cache_blocks,
    )
    return resolve_settings(limits, {}, backend="nxd", architecture="LlamaForCausalLM")


def stand_in_model(args: argparse.Namespace, settings: Any) -> Any:
    """An NxDI application as NxDKVState reaches it: per rank, a K and a V state tensor
    per layer in NxDI's prefix-caching shape (reserved block +1), each rank's heads as
    NxDI's GQA sharding gives them, on the stand-in device."""
    from neuronx_distributed_inference._device import on_device

    from neuron_plugin.core.kv_heads import model_head_sharding

    heads = model_head_sharding(hf_config(args), settings.tp_degree).kv_heads_per_core
    shape = (settings.num_blocks + 1, args.block_size, heads, args.head_dim)
    state = [
        {
            f"kv_mgr.past_key_values.{i}": on_device(
                torch.randn(shape, dtype=torch.float32).to(DTYPES[args.dtype])
            )
            for i in range(2 * args.layers)
        }
        for _ in range(settings.tp_degree)
    ]
    nxd_model = SimpleNamespace(state=state)
    return SimpleNamespace(
        neuron_config=SimpleNamespace(is_prefix_caching=True, kv_quant_config=None),
        context_encoding_model=SimpleNamespace(model=SimpleNamespace(nxd_model=nxd_model)),
    )


def sharding_kind(sharding: Any) -> str:
    """How NxDI lays the KV heads out over the ranks, in a few words."""
    if sharding.padded_kv_heads == sharding.kv_heads:
        return "split"
    padding = sum(h is None for h in sharding.slot_heads)
    if padding:
        return f"MHA, {padding} padding"
    return f"x{sharding.padded_kv_heads // sharding.kv_heads} replicas"


def timed(call: Any, repeat: int) -> float:
    """Median seconds of `call` over `repeat` runs after one warm-up."""
    call()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copies(call: Any) -> tuple[int, int, int]:
    """(copies, bytes, the most copies one thread issued) of one call."""
    from neuronx_distributed_inference._device import TRANSFER_THREADS, TRANSFERS

    TRANSFERS.clear()
    TRANSFER_THREADS.clear()
    call()
    chain = max(Counter(TRANSFER_THREADS).values())
    return len(TRANSFERS), sum(n for _, n in TRANSFERS), chain


def measure(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    from neuron_plugin.backends.nxd.kv_state import NxDKVState
    from neuron_plugin.core.kv_heads import model_head_sharding

    settings = settings_for(args, tp)
    state = NxDKVState(stand_in_model(args, settings), settings, False, hf_config(args), "nxd")
    sharding = model_head_sharding(hf_config(args), tp)
    geometry = state.geometry()
    ids = np.arange(1, 1 + args.blocks, dtype=np.int64)
    tokens = args.blocks * args.block_size
    kv = state.read(ids)
    read_copies, read_bytes, read_chain = copies(lambda: state.read(ids))
    write_copies, write_bytes, write_chain = copies(lambda: state.write(ids, kv))
    itemsize = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    return {
        "tp": tp,
        "strategy": sharding.strategy,
        "layout": sharding_kind(sharding),
        "kv_heads_per_core": sharding.kv_heads_per_core,
        "model_kv_bytes_per_token": 2 * args.layers * args.kv_heads * args.head_dim * itemsize,
        "payload_bytes_per_token": geometry.block_bytes // args.block_size,
        "read_bytes_per_token": read_bytes // tokens,
        "write_bytes_per_token": write_bytes // tokens,
        "read_copies": read_copies,
        "write_copies": write_copies,
        "read_chain": read_chain,
        "write_chain": write_chain,
        "read_us_per_block": 1e6 * timed(lambda: state.read(ids), args.repeat) / args.blocks,
        "write_us_per_block": 1e6 * timed(lambda: state.write(ids, kv), args.repeat) / args.blocks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--cache-blocks", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=8, help="consecutive blocks moved")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "kv_blocks")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(args, tp) for tp in args.tp]
    meta = run_meta(
        "bench_kv_blocks.py",
        argv,
        geometry=f"{args.layers} layers, {args.heads} attention heads, {args.kv_heads} KV "
        f"heads of {args.head_dim}, block {args.block_size}, {args.dtype}; "
        f"{args.blocks} consecutive blocks of a {args.cache_blocks}-block cache",
        torch=torch.__version__,
    )
    table = [
        [
            str(r["tp"]),
            f"{r['kv_heads_per_core']} ({r['layout']})",
            f"{r['model_kv_bytes_per_token'] / 1024:.0f}",
            f"{r['payload_bytes_per_token'] / 1024:.0f}",
            f"{r['read_bytes_per_token'] / 1024:.0f} / {r['write_bytes_per_token'] / 1024:.0f}",
            f"{r['read_copies']} / {r['write_copies']}",
            f"{r['read_chain']} / {r['write_chain']}",
            f"{r['read_us_per_block']:.0f} / {r['write_us_per_block']:.0f}",
        ]
        for r in rows
    ]
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "TP",
            "KV heads per core",
            "model KV KiB/token",
            "payload KiB/token",
            "read / write KiB/token copied",
            "copies read / write",
            "longest chain read / write",
            "stand-in µs per block read / write",
        ],
        table,
    )


if __name__ == "__main__":
    main()
