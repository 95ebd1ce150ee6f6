"""Decode step cost against context length: Qwen3.5 (gated DeltaNet layers beside gated
attention) against a full-attention model of the same width, on the reference backend,
whose graphs have a device's cost structure (one fixed-shape graph per bucket; a decode
graph attends over its whole context bucket, as NxDI's do).

Two checkpoints of the same width and depth, random weights (timing only), written here:
Qwen3.5 (`Qwen3_5ForCausalLM`: 8 layers, full attention every fourth as the Hub's
models, so 2 attention and 6 state layers) and Qwen3 (`Qwen3ForCausalLM`: 8
full-attention layers), both hidden 512, 8 query heads and 2 KV heads of 64, MLP 1024;
Qwen3.5's state layers 4 key heads and 8 value heads of 64. Each is compiled with one
token-generation graph per context bucket; per bucket, the median backend time of a
decode call of `--batch` rows (a padding call of exactly that shape: a graph's cost does
not depend on its rows' values), and what a decode step reads per sequence: the KV
cache of its attention layers up to the bucket's length, and the state layers' state
(read and written back, fixed whatever the length). The second table is the same
arithmetic for Qwen3.5-27B against a 64-layer full-attention model of its width
(bfloat16): what a device's decode step streams from HBM per sequence.

    python scripts/bench_state_decode.py --out bench-results/state_decode
writes state_decode.json and state_decode.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_report import run_meta, write_results  # noqa: E402

CONTEXTS = (512, 1024, 2048, 4096, 8192)
WIDTH = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "vocab_size": 1024,
}
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Qwen3.5": (
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        {
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
            },
        },
    ),
    "Qwen3": (
        "qwen3",
        "Qwen3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    ),
}
# Qwen3.5-27B's text config (the Hub's), and a full-attention model of its width.
QWEN3_5_27B = {
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}


def checkpoint(name: str, folder: Path) -> Path:
    """A random-weight checkpoint of `name` (MODELS) in `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, architecture, fields = MODELS[name]
    fields = dict(fields)
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"] * (WIDTH["num_hidden_layers"] // 4)
    config = AutoConfig.for_model(model_type, **WIDTH, **fields, architectures=[architecture])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def read_bytes(config: dict[str, Any], context: int, dtype_bytes: int) -> tuple[int, int]:
    """(KV bytes, state bytes read and written) of one sequence's decode step at
    `context` positions."""
    from neuron_plugin.core.recurrent_state import state_geometry

    state = state_geometry(config)
    layers = int(config["num_hidden_layers"]) - (len(state.layers) if state else 0)
    kv = 2 * layers * int(config["num_key_value_heads"]) * int(config["head_dim"])
    dtype = {4: "float32", 2: "bfloat16"}[dtype_bytes]
    return kv * dtype_bytes * context, 2 * (state.sequence_bytes(dtype) if state else 0)


def time_decodes(model: Path, architecture: str, batch: int, calls: int) -> dict[int, float]:
    """Median CPU ms of a decode call per context bucket (this process's CPU time on one
    thread, which other processes' load on the machine does not inflate as it does wall
    time): the bucket's graph (the
    DecoderGraph the reference backend exports for it) run eagerly on a call of exactly
    that shape, its caches written in place as a device's aliased caches are (an
    exported graph's functional copy of the whole cache would cost the same at every
    bucket and hide the difference)."""
    import torch

    from neuron_plugin.backends.reference.backend import ReferenceBackend
    from neuron_plugin.backends.reference.decoder import load_weights
    from neuron_plugin.core.checkpoint import read_hf_config
    from neuron_plugin.core.inputs import TOKEN_GENERATION, padding_inputs
    from neuron_plugin.core.recurrent_state import state_geometry
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    limits = EngineLimits(
        max_model_len=CONTEXTS[-1],
        max_num_seqs=batch,
        block_size=None,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=CONTEXTS[-1],
        dtype="float32",
        state=state_geometry(read_hf_config(model)),
    )
    override = {
        "context_encoding_buckets": [128],
        "max_context_length": 128,
        "token_generation_buckets": list(CONTEXTS),
        "on_device_sampling_config": None,
    }
    settings = resolve_settings(limits, override, backend="reference", architecture=architecture)
    backend = ReferenceBackend(settings, model)
    weights = load_weights(model, backend.spec, torch.float32)
    k_cache = torch.zeros(backend._cache_shape())
    v_cache = k_cache.clone()
    if backend.states is not None:
        backend.states.load()
    medians = {}
    for context in CONTEXTS:
        inputs = padding_inputs(settings, TOKEN_GENERATION, (batch, context))
        write, read = backend._slots(inputs)
        args = [torch.from_numpy(a.copy()) for a in (inputs.input_ids, inputs.position_ids)]
        args += [torch.from_numpy(a.copy()) for a in (write, read, inputs.full_context_lens)]
        state = {} if backend.states is None else backend.states.inputs(inputs, batch)
        times = []
        with torch.inference_mode():
            for call in range(calls + 2):  # two warm-up calls
                start = time.process_time()
                backend.module(
                    weights, *args, torch.zeros(batch, dtype=torch.int64), k_cache, v_cache, **state
                )
                if call >= 2:
                    times.append(time.process_time() - start)
        medians[context] = 1000 * statistics.median(times)
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output path, no suffix")
    parser.add_argument("--batch", type=int, default=4, help="decode rows a call")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per bucket")
    args = parser.parse_args(argv)
    import torch

    from neuron_plugin.core.checkpoint import read_hf_config

    torch.set_num_threads(1)  # CPU time then measures the work, whatever else runs

    measured: dict[str, dict[int, float]] = {}
    configs = {}
    with tempfile.TemporaryDirectory() as models:
        for name, (_, architecture, _) in MODELS.items():
            folder = checkpoint(name, Path(models) / name)
            configs[name] = read_hf_config(folder)
            measured[name] = time_decodes(folder, architecture, args.batch, args.calls)
    rows, table = [], []
    for context in CONTEXTS:
        hybrid, full = measured["Qwen3.5"][context], measured["Qwen3"][context]
        kv_h, state_h = read_bytes(configs["Qwen3.5"], context, 4)
        kv_f, _ = read_bytes(configs["Qwen3"], context, 4)
        rows.append(
            {
                "context": context,
                "qwen3_5_ms": hybrid,
                "qwen3_ms": full,
                "qwen3_5_kv_bytes": kv_h,
                "qwen3_5_state_bytes": state_h,
                "qwen3_kv_bytes": kv_f,
            }
        )
        table.append(
            [
                str(context),
                f"{full:.1f}",
                f"{hybrid:.1f}",
                f"{hybrid / full:.2f}",
                f"{kv_f / 2**20:.2f}",
                f"{(kv_h + state_h) / 2**20:.2f}",
            ]
        )
    device = []
    for context in (4096, 32768, 262144):
        kv, state = read_bytes(QWEN3_5_27B, context, 2)
        dense = 2 * 64 * 4 * 256 * 2 * context
        device.append(
            {"context": context, "qwen3_5_27b_bytes": kv + state, "full_attention_bytes": dense}
        )
    meta = run_meta(
        "bench_state_decode.py",
        argv,
        batch=args.batch,
        calls=args.calls,
        load_average=os.getloadavg()[0],
    )
    header = [
        "context",
        "Qwen3 CPU ms",
        "Qwen3.5 CPU ms",
        "ratio",
        "Qwen3 MiB read",
        "Qwen3.5 MiB read",
    ]
    write_results(args.out, meta, {"rows": rows, "device": device}, header, table)
    for row in device:
        print(
            f"27B at {row['context']}: {row['qwen3_5_27b_bytes'] / 2**20:.0f} MiB vs "
            f"{row['full_attention_bytes'] / 2**20:.0f} MiB a sequence"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
