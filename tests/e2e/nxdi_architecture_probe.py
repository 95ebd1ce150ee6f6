"""Run under an interpreter with NxD Inference (its CPU mode): one architecture's tiny
checkpoint through the plugin's NxD backend on real NxDI, in the cases
test_nxdi_architectures.py compares with transformers; prints one JSON object.

    python nxdi_architecture_probe.py PLAN_JSON OUT_DIR

PLAN: {"model": dir, "steps": N, "layouts": {"contiguous": SETTINGS, "block": SETTINGS},
"prompts": {"a": [...], "b": [...], "c": [...], "d": [...], "r": [...] with "staggered"},
"prefix": tokens cached}
(settings resolved by the test: this side has no vLLM). Per layout:
- batch1: prompt a prefilled, then N greedy decode steps (logits: `forward`);
- batch2: prompts a and b prefilled, then decoded together;
- device_sampling: batch2 with NxDI's on-device sampler (greedy rows: `run`), where the
  settings compile it in and the CPU mode can run it (not sharded);
and in the block layout
- prefix_hit: c's first `prefix` tokens cached by a shorter prompt (c[:prefix + 1]),
  then c prefilled over them (a prefill over a cached prefix) and decoded;
- prefix_control: the same, the cached blocks holding d's prefix instead: must differ;
and with "staggered" in the plan (a model with per-sequence state), in the contiguous
layout
- staggered: continuous batching with b arriving later: a prefilled (slot 0) and decoded
  alone, b prefilled (slot 1), a decoded alone again (slot 1, b's live state, is then a
  pad row), then both together, each row until it has N + 1 tokens;
- long: c (past two 64-token DeltaNet chunks, in the 256 bucket) prefilled and decoded;
- repeated: r (one token repeated across two chunks) prefilled and decoded;
- cast_dtypes: the dtype of every cache entry (`past_key_values`) once the cache manager
  is cast to bfloat16 as NxDI casts a model (to_cpu's .bfloat16(), load_module's .to()),
  after the other cases.
Each case gives every row's tokens (the prefill's and N decoded); the logits cases write
every step's logits of every row to OUT_DIR/LAYOUT-CASE.npy (float32 [rows, N + 1,
vocab]). A layout the backend refuses gives its error message instead ({"refused":
message}): refusals come before anything compiles. Under torchrun (one process per
rank of a sharded model) each rank writes into OUT_DIR/rankN and rank 0 prints.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.nxdi_cpu_mode import sharded_sampler_problem
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings


def greedy(rows: int) -> SamplingInputs:
    return SamplingInputs(
        top_k=np.ones(rows, dtype=np.int32),
        top_p=np.ones(rows, dtype=np.float32),
        temperature=np.ones(rows, dtype=np.float32),
        uniform=np.zeros((rows, 1), dtype=np.float32),
        needs_logits=np.zeros(rows, dtype=bool),
    )


class Driver:
    """Requests on one loaded backend, each row in its own sequence slot / blocks."""

    def __init__(self, settings: NeuronSettings, model_dir: str, folder: Path):
        self.settings = settings
        self.backend = NxDBackend(settings, model_dir)
        folder.mkdir()
        self.backend.compile(folder)
        self.backend.load(folder)
        self.per_seq = settings.max_blocks_per_seq

    def blocks(self, slot: int) -> list[int] | None:
        if not self.settings.is_block_layout:
            return None
        return [1 + self.per_seq * slot + j for j in range(self.per_seq)]

    def step(self, inputs: Any, rows: int, device: bool) -> tuple[list[int], list[list[float]]]:
        if device:
            return [int(t) for t in self.backend.run(inputs, greedy(rows)).tokens[:, 0]], []
        logits = self.backend.forward(inputs)
        return [int(t) for t in logits.argmax(-1)], logits.tolist()

    def prefill(
        self, prompt: list[int], start: int, slot: int, blocks: list[int] | None, device: bool
    ) -> tuple[int, list[float]]:
        inputs = context_encoding_inputs(self.settings, np.array(prompt), start, slot, blocks)
        tokens, logits = self.step(inputs, 1, device)
        return tokens[0], (logits[0] if logits else [])

    def generate(
        self,
        prompts: list[list[int]],
        steps: int,
        device: bool = False,
        starts: list[int] | None = None,
        tables: list[list[int] | None] | None = None,
    ) -> dict[str, Any]:
        """Each prompt prefilled (from `starts`, over `tables`' blocks), then all decoded
        together for `steps` steps."""
        rows = len(prompts)
        tables = tables or [self.blocks(slot) for slot in range(rows)]
        tokens: list[list[int]] = []
        logits: list[list[list[float]]] = []
        for slot, prompt in enumerate(prompts):
            start = starts[slot] if starts else 0
            token, row = self.prefill(prompt, start, slot, tables[slot], device)
            tokens.append([token])
            logits.append([row] if row else [])
        for _ in range(steps):
            positions = np.array([len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)])
            inputs = token_generation_inputs(
                self.settings,
                np.array([t[-1] for t in tokens]),
                positions,
                np.arange(rows),
                tables if self.settings.is_block_layout else None,
                logits=not device,
            )
            step_tokens, step_logits = self.step(inputs, rows, device)
            for row in range(rows):
                tokens[row].append(step_tokens[row])
                if step_logits:
                    logits[row].append(step_logits[row])
        return {"tokens": tokens, "logits": logits}


def staggered_case(driver: Driver, first: list[int], second: list[int], steps: int):
    """See the module docstring: rows (slots) 0 and 1 of the result are `first` and
    `second`."""
    prompts = [first, second]
    tokens: list[list[int]] = [[], []]
    logits: list[list[list[float]]] = [[], []]

    def prefill(slot: int) -> None:
        token, row = driver.prefill(prompts[slot], 0, slot, None, device=False)
        tokens[slot].append(token)
        logits[slot].append(row)

    def decode(slots: list[int]) -> None:
        positions = np.array([len(prompts[s]) + len(tokens[s]) - 1 for s in slots])
        inputs = token_generation_inputs(
            driver.settings,
            np.array([tokens[s][-1] for s in slots]),
            positions,
            np.array(slots),
            None,
            logits=True,
        )
        step_tokens, step_logits = driver.step(inputs, len(slots), device=False)
        for row, slot in enumerate(slots):
            tokens[slot].append(step_tokens[row])
            logits[slot].append(step_logits[row])

    prefill(0)
    decode([0])
    decode([0])
    prefill(1)
    decode([0])
    while True:
        slots = [s for s in (0, 1) if len(tokens[s]) < steps + 1]
        if not slots:
            return {"tokens": tokens, "logits": logits}
        decode(slots)


def prefix_case(driver: Driver, cached: list[int], prompt: list[int], prefix: int, steps: int):
    """`cached` prefilled into slot 0's blocks, then `prompt` over its first `prefix`
    tokens' blocks (slot 1's for the rest)."""
    own, other = driver.blocks(0), driver.blocks(1)
    assert own is not None and other is not None
    driver.prefill(cached, 0, 0, own, device=False)
    shared = own[: prefix // driver.settings.block_size]
    table = shared + other[len(shared) :]
    return driver.generate([prompt], steps, starts=[prefix], tables=[table])


def run_layout(
    name: str, settings: NeuronSettings, plan: dict[str, Any], out: Path
) -> dict[str, Any]:
    try:
        driver = Driver(settings, plan["model"], out / f"{name}-graphs")
    except NeuronConfigError as exc:
        return {"refused": str(exc)}
    prompts, steps = plan["prompts"], plan["steps"]
    cases = {
        "batch1": driver.generate([prompts["a"]], steps),
        "batch2": driver.generate([prompts["a"], prompts["b"]], steps),
    }
    if settings.on_device_sampling and sharded_sampler_problem(settings) is None:
        cases["device_sampling"] = driver.generate([prompts["a"], prompts["b"]], steps, True)
    if plan.get("staggered") and not settings.is_block_layout:
        cases["staggered"] = staggered_case(driver, prompts["a"], prompts["b"], steps)
        cases["long"] = driver.generate([prompts["c"]], steps)
        cases["repeated"] = driver.generate([prompts["r"]], steps)
    if settings.is_block_layout:
        prefix, c, d = plan["prefix"], prompts["c"], prompts["d"]
        cases["prefix_hit"] = prefix_case(driver, c[: prefix + 1], c, prefix, steps)
        cases["prefix_control"] = prefix_case(driver, d[: prefix + 1], c, prefix, steps)
    for case, result in cases.items():
        logits = result.pop("logits")
        if logits[0]:
            np.save(out / f"{name}-{case}.npy", np.array(logits, dtype=np.float32))
    if plan.get("staggered") and not settings.is_block_layout:
        manager = driver.backend.model.token_generation_model.model.kv_mgr
        manager.bfloat16()
        cases["cast_dtypes"] = [str(p.dtype) for p in manager.past_key_values]
    return cases


def main(plan: dict[str, Any], out: Path) -> dict[str, Any]:
    return {
        layout: run_layout(layout, NeuronSettings.from_dict(settings), plan, out)
        for layout, settings in plan["layouts"].items()
    }


if __name__ == "__main__":
    # Under torchrun (a sharded model, one process per rank) each rank compiles into its
    # own folder and rank 0 reports.
    rank = os.environ.get("RANK")
    out = Path(sys.argv[2]) if rank is None else Path(sys.argv[2]) / f"rank{rank}"
    out.mkdir(exist_ok=True)
    report = main(json.loads(Path(sys.argv[1]).read_text()), out)
    if rank in (None, "0"):
        print(json.dumps(report))
