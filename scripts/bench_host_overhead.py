"""Host overhead of one decode step in the plugin, at batch 1/4/32/128 and
max_model_len 2k/8k/32k.

The findings measured vLLM adding ~46-56 ms per batch over NxD direct on inf2, so the
plugin's own host work per step (scheduler-output bookkeeping, input preparation, bucket
pick, vLLM's sampler, output handling) must stay small and must not grow with
max_model_len. This drives the real `NeuronModelRunner` with real vLLM scheduler outputs
and a backend that returns logits without computing (`HostOnlyBackend`), so the time
measured is host time only; `inputs_us` isolates `token_generation_inputs` (the NxD
contract arrays). The step fraction uses the reference backend's measured forward time
for the same token-generation bucket where its KV cache fits in memory (tiny model, so
the fraction is an upper bound for real models).

    python scripts/bench_host_overhead.py --out bench-results/host_overhead
writes host_overhead.json and host_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from neuron_plugin.backends.base import AdapterLoading, StepOutput
    from neuron_plugin.backends.kv_blocks import KVGeometry
    from neuron_plugin.core.adapters import AdapterWeights
    from neuron_plugin.core.inputs import ForwardInputs
    from neuron_plugin.core.sampling import SamplingInputs
    from neuron_plugin.core.settings import NeuronSettings
    from neuron_plugin.core.vision import ImageInputs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from bench_report import run_meta, write_results  # noqa: E402

BATCHES = (1, 4, 32, 128)
LENGTHS = (2048, 8192, 32768)
PROMPT = 128
# The reference forward is timed only where its KV cache stays under this size.
FORWARD_MEMORY_LIMIT = 3 * 2**30


class HostOnlyBackend:
    """Returns zero logits at once: what remains of a step is host work."""

    name = "host-only"
    module = None

    def __init__(self, settings: NeuronSettings, vocab: int):
        self.settings = settings
        self.vocab = vocab

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        import torch

        return torch.zeros((inputs.num_real, self.vocab))

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        import torch

        from neuron_plugin.backends.base import StepOutput

        return StepOutput(
            tokens=np.zeros(inputs.num_real, dtype=np.int32),
            logits=torch.zeros((int(sampling.needs_logits.sum()), self.vocab)),
        )

    def submit(self, inputs: ForwardInputs, sampling: SamplingInputs) -> None:
        self._submitted = self.run(inputs, sampling)

    def collect(self) -> StepOutput:
        return self._submitted

    @property
    def adapter_loading(self) -> AdapterLoading:
        from neuron_plugin.backends.base import AdapterLoading

        return AdapterLoading(at_run_time=False, why="the host-only benchmark serves no adapters")

    def set_adapter(self, slot: int, adapter: AdapterWeights) -> None:
        raise ValueError("the host-only backend measures serving without LoRA adapters")

    def encode_image(self, image: ImageInputs) -> np.ndarray:
        raise ValueError("the host-only backend measures serving without images")

    # No KV cache: nothing to transfer (the benchmark serves no disaggregated requests).
    def kv_geometry(self) -> KVGeometry:
        raise RuntimeError("the host-only benchmark backend holds no KV cache")

    def read_kv_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        raise RuntimeError("the host-only benchmark backend holds no KV cache")

    def write_kv_blocks(self, block_ids: np.ndarray, kv: torch.Tensor) -> None:
        raise RuntimeError("the host-only benchmark backend holds no KV cache")


def vllm_config_for(model: Path, batch: int, length: int):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model),
        dtype="float32",
        max_model_len=length,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        additional_config={
            "override_neuron_config": {
                # Host sampling: this measures vLLM's sampler on every row
                # (scripts/bench_sampling.py measures on-device sampling).
                "on_device_sampling_config": None,
                "token_generation_batches": sorted(
                    {1, 4, 32, 128, batch} & set(range(1, batch + 1))
                ),
            }
        },
    )
    config = args.create_engine_config()
    return config, set_current_vllm_config(config)


def new_requests(batch: int, vocab: int, length: int):
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    rng = np.random.default_rng(0)
    return [
        NewRequestData(
            req_id=f"r{i}",
            prompt_token_ids=rng.integers(5, vocab, PROMPT).tolist(),
            mm_features=[],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=length),
            pooling_params=None,
            block_ids=([i + 1],),
            num_computed_tokens=0,
            lora_request=None,
        )
        for i in range(batch)
    ]


def scheduler_output(new=(), cached=None, scheduled=None):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def measure_host(model: Path, batch: int, length: int, steps: int) -> dict:
    from vllm.v1.core.sched.output import CachedRequestData

    from neuron_plugin.core.inputs import token_generation_inputs
    from neuron_plugin.serving.model_runner import NeuronModelRunner
    from neuron_plugin.serving.telemetry import StepTelemetry
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config, context = vllm_config_for(model, batch, length)
    with context:
        settings = settings_from_vllm_config(config)
        vocab = config.model_config.get_vocab_size()
        runner = NeuronModelRunner(
            config, settings, HostOnlyBackend(settings, vocab), [StepTelemetry(publish_dir=None)]
        )
        reqs = new_requests(batch, vocab, length)
        runner.execute_model(scheduler_output(new=reqs, scheduled={r.req_id: PROMPT for r in reqs}))
        runner.sample_tokens(None)
        # Decode from the middle of the context so the largest buckets are in play.
        position = length // 2
        ids = [r.req_id for r in reqs]
        times = []
        for step in range(steps):
            cached = CachedRequestData(
                req_ids=ids,
                resumed_req_ids=set(),
                new_token_ids=[],
                all_token_ids={},
                new_block_ids=[None] * batch,
                num_computed_tokens=[position + step] * batch,
                num_output_tokens=[1 + step] * batch,
            )
            out = scheduler_output(cached=cached, scheduled=dict.fromkeys(ids, 1))
            start = time.perf_counter()
            runner.execute_model(out)
            runner.sample_tokens(None)
            times.append(time.perf_counter() - start)
            for index in range(batch):  # keep the context where the next step expects it
                runner.input_batch.num_tokens_no_spec[index] = position + step + 2
        positions = np.full(batch, position, dtype=np.int64)
        seq_ids = np.arange(batch, dtype=np.int64)
        tokens = np.zeros(batch, dtype=np.int64)
        prep = []
        for _ in range(steps):
            start = time.perf_counter()
            inputs = token_generation_inputs(settings, tokens, positions, seq_ids, None)
            prep.append(time.perf_counter() - start)
    return {
        "batch": batch,
        "max_model_len": length,
        "bucket": list(inputs.bucket),
        "step_us": 1e6 * statistics.median(times[steps // 5 :]),
        "inputs_us": 1e6 * statistics.median(prep[steps // 5 :]),
    }


def measure_forward(model: Path, batch: int, length: int, bucket: list[int], repeats: int):
    """Reference-backend forward time (ms) of one token-generation bucket, or None."""
    import torch

    from neuron_plugin.backends.base import GraphSpec
    from neuron_plugin.backends.reference.backend import ReferenceBackend
    from neuron_plugin.backends.reference.decoder import load_weights
    from neuron_plugin.core.inputs import TOKEN_GENERATION

    config, context = vllm_config_for(model, batch, length)
    with context:
        from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

        backend = ReferenceBackend(settings_from_vllm_config(config), model)
    spec = backend.spec
    cache_bytes = 2 * spec.num_layers * backend.num_slots * spec.num_kv_heads * spec.head_dim * 4
    if cache_bytes > FORWARD_MEMORY_LIMIT:
        return None
    weights = load_weights(model, spec, torch.float32)
    args = backend._example_inputs(GraphSpec(TOKEN_GENERATION, tuple(bucket)), weights)
    with torch.inference_mode():
        backend.module(*args)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.module(*args)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama-32k")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--forward-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "host_overhead")
    args = parser.parse_args(argv)
    from build_tiny_model import build

    build("llama", args.model, max_positions=max(LENGTHS))
    rows = []
    for length in LENGTHS:
        for batch in BATCHES:
            row = measure_host(args.model, batch, length, args.steps)
            ms = measure_forward(args.model, batch, length, row["bucket"], args.forward_repeats)
            row["forward_ms"] = ms
            row["host_fraction"] = (
                None if ms is None else row["step_us"] / (row["step_us"] + 1000 * ms)
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = run_meta("bench_host_overhead.py", argv, steps=args.steps, prompt_tokens=PROMPT)
    table = []
    for r in rows:
        fwd = (
            "not measured (KV cache > 3 GiB)"
            if r["forward_ms"] is None
            else f"{r['forward_ms']:.2f}"
        )
        frac = "-" if r["host_fraction"] is None else f"{100 * r['host_fraction']:.1f}%"
        table.append(
            [
                str(r["max_model_len"]),
                str(r["batch"]),
                "x".join(map(str, r["bucket"])),
                f"{r['step_us']:.0f}",
                f"{r['inputs_us']:.0f}",
                fwd,
                frac,
            ]
        )
    write_results(
        args.out,
        meta,
        {"rows": rows},
        [
            "max_model_len",
            "batch",
            "TKG bucket",
            "host us/step (median)",
            "of which inputs us",
            "reference forward ms",
            "host fraction of step",
        ],
        table,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
