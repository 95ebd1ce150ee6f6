"""On-device sampling at Qwen3's vocabulary (151,936): host time per decode step and
bytes per step across the backend seam, at batch 1 / 4 / 32, with on-device sampling on
and off, with the backend in-process and in a runner process (by default in the
torch-2.9 environment that scripts/setup-backend-env.sh builds).

Drives the real `NeuronModelRunner` with real vLLM scheduler outputs on the reference
backend and a one-layer Qwen3-shaped checkpoint with 151,936 vocabulary rows
(scripts/build_tiny_model.py --model-vocab). Host time is the runner's own per-step
measure (what `neuron:step_host_seconds` exports: the step minus its backend calls;
through the runner the process boundary is part of the backend call, whose fixed cost
scripts/bench_runner.py measures). Bytes are counted per step: the arrays a call hands
the backend (the NxD contract arrays and, with on-device sampling, the sampling arrays),
the arrays it gets back (tokens, logits), and through the runner its JSON control
messages.

Workloads: greedy (every row), sampled (T 0.8, top-k 50, top-p 0.9 on every row: what
the device sampler serves), mixed (sampled rows plus one greedy row asking for
logprobs, whose logits come back so vLLM's Sampler runs for it).

    python scripts/bench_sampling.py --out bench-results/sampling
writes sampling.json and sampling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from neuron_plugin.backends.base import LoadedBackend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report import run_meta, write_results  # noqa: E402

BATCHES = (1, 4, 32)
WORKLOADS = ("greedy", "sampled", "mixed")
PROMPT = 16
MAX_MODEL_LEN = 128


class StepClock:
    """Observer: each step's host time and each backend call's time."""

    def __init__(self):
        self.host_s: list[float] = []
        self.forward_s: list[float] = []

    def on_backend_call(self, inputs, forward_s: float, host_s: float, accepted: int = 0) -> None:
        self.forward_s.append(forward_s)

    def on_vision_call(self, bucket: int, patches: int, forward_s: float) -> None:
        pass  # text models only

    def on_step(self, host_s: float) -> None:
        self.host_s.append(host_s)

    def on_request_finished(self, request) -> None:
        pass


class SeamMeter:
    """The backend, counting the bytes its calls move across the seam."""

    def __init__(self, backend: LoadedBackend):
        self.backend = backend
        self.name = backend.name
        self.settings = backend.settings
        self.counts = {"in": 0, "tokens": 0, "logits": 0, "control": 0, "device_rows": 0}
        runner = getattr(backend, "runner", None)
        if runner is not None:  # every message goes through send and receive
            runner.send = self._counted_send(runner.send)
            runner.receive = self._counted_receive(runner.receive)

    def _count(self, message) -> None:
        self.counts["control"] += 4 + len(json.dumps(message, separators=(",", ":")))

    def _counted_send(self, send):
        def counted(op, **fields):
            send(op, **fields)
            self._count({"op": op, **fields})  # 4-byte length + JSON

        return counted

    def _counted_receive(self, receive):
        def counted(op):
            reply = receive(op)
            self._count(reply)
            return reply

        return counted

    def _arrays_in(self, inputs, extra) -> None:
        from neuron_plugin.backends.runner.protocol import encode_inputs

        _, arrays = encode_inputs(inputs)
        self.counts["in"] += sum(a.nbytes for a in [*arrays.values(), *extra])

    def forward(self, inputs):
        logits = self.backend.forward(inputs)
        self._arrays_in(inputs, [])
        self.counts["logits"] += logits.numel() * logits.element_size()
        return logits

    def run(self, inputs, sampling):
        out = self.backend.run(inputs, sampling)
        self._arrays_in(inputs, sampling.arrays().values())
        self.counts["tokens"] += out.tokens.nbytes
        self.counts["logits"] += out.logits.numel() * out.logits.element_size()
        self.counts["device_rows"] += int((~sampling.needs_logits).sum())
        return out

    def submit(self, inputs, sampling) -> None:
        self._submitted = self.run(inputs, sampling)

    def collect(self):
        return self._submitted

    @property
    def adapter_loading(self):
        return self.backend.adapter_loading

    def set_adapter(self, slot, adapter) -> None:
        self.backend.set_adapter(slot, adapter)

    def encode_image(self, image):
        return self.backend.encode_image(image)

    @property
    def module(self) -> torch.nn.Module | None:
        return self.backend.module

    # KV blocks are not part of this benchmark: passed through uncounted.
    def kv_geometry(self):
        return self.backend.kv_geometry()

    def read_kv_blocks(self, block_ids):
        return self.backend.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids, kv) -> None:
        self.backend.write_kv_blocks(block_ids, kv)

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)


def engine_config(model: Path, batch: int, on_device: bool, python: str | None):
    from vllm.engine.arg_utils import EngineArgs

    override: dict[str, list[int] | None] = {
        "context_encoding_buckets": [PROMPT * 2],
        "token_generation_buckets": [MAX_MODEL_LEN],
        "token_generation_batches": [batch],
    }
    if not on_device:
        override["on_device_sampling_config"] = None
    extra = {"backend_python": python} if python else {}
    return EngineArgs(
        model=str(model),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        additional_config={"override_neuron_config": override, **extra},
    ).create_engine_config()


def sampling_params(workload: str, index: int):
    from vllm import SamplingParams

    if workload == "greedy" or (workload == "mixed" and index == 0):
        return SamplingParams(
            temperature=0.0, max_tokens=MAX_MODEL_LEN, logprobs=1 if workload == "mixed" else None
        )
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=MAX_MODEL_LEN)


def decode_steps(config, settings, backend, workload: str, batch: int, steps: int) -> dict:
    """Prefill `batch` requests, then `steps` decode steps; per-step medians."""
    from bench_host_overhead import scheduler_output
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from neuron_plugin.serving.model_runner import NeuronModelRunner

    clock, meter = StepClock(), SeamMeter(backend)
    runner = NeuronModelRunner(config, settings, meter, [clock])
    rng = np.random.default_rng(0)
    requests = [
        NewRequestData(
            req_id=f"r{i}",
            prompt_token_ids=rng.integers(5, 900, PROMPT).tolist(),
            mm_features=[],
            sampling_params=sampling_params(workload, i),
            pooling_params=None,
            block_ids=([i + 1],),
            num_computed_tokens=0,
            lora_request=None,
        )
        for i in range(batch)
    ]
    ids = [r.req_id for r in requests]
    runner.execute_model(scheduler_output(new=requests, scheduled=dict.fromkeys(ids, PROMPT)))
    runner.sample_tokens(None)
    clock.host_s.clear()
    clock.forward_s.clear()
    meter.reset()
    for step in range(steps):
        cached = CachedRequestData(
            req_ids=ids,
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * batch,
            num_computed_tokens=[PROMPT + step] * batch,
            num_output_tokens=[1 + step] * batch,
        )
        runner.execute_model(scheduler_output(cached=cached, scheduled=dict.fromkeys(ids, 1)))
        runner.sample_tokens(None)
    skip = steps // 5  # warm-up
    per_step = {f"{k}_per_step": v / steps for k, v in meter.counts.items()}
    return {
        "host_us": 1e6 * statistics.median(clock.host_s[skip:]),
        "call_ms": 1e3 * statistics.median(clock.forward_s[skip:]),
        **per_step,
    }


def measure(
    model: Path, batch: int, on_device: bool, python: str | None, steps: int, cache: str
) -> list[dict]:
    from vllm.config import set_current_vllm_config

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model, batch, on_device, python)
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
        backend = open_backend(settings, model, cache)
        try:
            rows = []
            for workload in WORKLOADS:
                row = decode_steps(config, settings, backend, workload, batch, steps)
                row.update(
                    batch=batch,
                    workload=workload,
                    on_device=on_device,
                    path="runner" if python else "in-process",
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
            return rows
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per (batch, workload, sampling): in-process and runner side by side.
    Bytes are per decode step; "per device row" is every array but logits (contract
    arrays in, sampling arrays in, token out) divided by the rows."""
    by_key = {(r["batch"], r["workload"], r["on_device"], r["path"]): r for r in rows}
    lines = []
    for batch in BATCHES:
        for workload in WORKLOADS:
            for on_device in (False, True):
                local = by_key[(batch, workload, on_device, "in-process")]
                remote = by_key.get((batch, workload, on_device, "runner"))
                arrays = local["in_per_step"] + local["tokens_per_step"]
                lines.append(
                    [
                        str(batch),
                        workload,
                        "on" if on_device else "off",
                        f"{local['host_us']:.0f}",
                        "-" if remote is None else f"{remote['host_us']:.0f}",
                        f"{local['logits_per_step']:,.0f}",
                        f"{arrays:,.0f}",
                        f"{arrays / batch:.0f}" if on_device else "-",
                        "-" if remote is None else f"{remote['control_per_step']:,.0f}",
                        f"{local['call_ms']:.1f}",
                    ]
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "qwen3-vocab151936")
    parser.add_argument(
        "--python",
        default=str(ROOT / ".venv-sdk" / "bin" / "python"),
        help="the runner's interpreter (default: .venv-sdk's); '' skips the runner",
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "sampling")
    args = parser.parse_args(argv)
    from build_tiny_model import QWEN3_VOCAB, build

    model = build("qwen3", args.model, layers=1, model_vocab=QWEN3_VOCAB)
    paths = [None, args.python] if args.python else [None]
    with tempfile.TemporaryDirectory() as cache:
        rows = [
            row
            for batch in BATCHES
            for on_device in (False, True)
            for python in paths
            for row in measure(model, batch, on_device, python, args.steps, cache)
        ]
    meta = run_meta(
        "bench_sampling.py", argv, vocab=QWEN3_VOCAB, steps=args.steps, prompt_tokens=PROMPT
    )
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "batch",
            "workload",
            "on-device sampling",
            "host us/step in-process",
            "host us/step runner",
            "logits bytes/step",
            "other array bytes/step",
            "array bytes per row",
            "control bytes/step (runner)",
            "backend call ms in-process",
        ],
        table_rows(rows),
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
    sys.exit(main())
