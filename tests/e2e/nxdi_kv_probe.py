"""Run under an interpreter with NxD Inference (its CPU mode): a prompt's KV blocks read
out of one NxD backend on real NxDI (`read_kv_blocks`) and written into other blocks of a
second one (`write_kv_blocks`), which then decodes from them. Used by
test_nxdi_cpu_mode.py (which resolves the settings: this side has no vLLM); prints one
JSON object: NxDI's KV state tensor shape, the geometry, and the greedy tokens each
backend decodes.

    python nxdi_kv_probe.py SETTINGS_JSON MODEL_DIR PROMPT_JSON STEPS
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronSettings


def greedy(rows: int) -> SamplingInputs:
    return SamplingInputs(
        top_k=np.ones(rows, dtype=np.int32),
        top_p=np.ones(rows, dtype=np.float32),
        temperature=np.ones(rows, dtype=np.float32),
        uniform=np.zeros(rows, dtype=np.float32),
        needs_logits=np.zeros(rows, dtype=bool),
    )


def loaded(settings: NeuronSettings, model_dir: str) -> NxDBackend:
    backend = NxDBackend(settings, model_dir)
    folder = Path(tempfile.mkdtemp())
    backend.compile(folder)
    backend.load(folder)
    return backend


def decode(
    backend: NxDBackend, settings: NeuronSettings, prompt: list[int], first: int,
    blocks: list[int], steps: int,
) -> list[int]:  # fmt: skip
    """Greedy tokens from the request's KV in `blocks`, its next token `first`."""
    tokens = [first]
    for _ in range(steps):
        position = len(prompt) + len(tokens) - 1
        inputs = token_generation_inputs(
            settings, np.array([tokens[-1]]), np.array([position]), np.array([0]), [blocks]
        )
        tokens.append(int(backend.run(inputs, greedy(1)).tokens[0, 0]))
    return tokens


def main(settings_json: str, model_dir: str, prompt: list[int], steps: int) -> dict[str, Any]:
    settings = NeuronSettings.from_dict(json.loads(settings_json))
    prefill, target = loaded(settings, model_dir), loaded(settings, model_dir)
    count = math.ceil((len(prompt) + steps) / settings.block_size)
    here = list(range(1, 1 + count))
    there = list(range(settings.num_blocks - count, settings.num_blocks))  # other blocks
    out = prefill.run(context_encoding_inputs(settings, np.array(prompt), 0, 0, here), greedy(1))
    first = int(out.tokens[0, 0])
    used = math.ceil(len(prompt) / settings.block_size)
    kv = prefill.read_kv_blocks(np.array(here[:used])).clone()
    target.write_kv_blocks(np.array(there[:used]), kv)
    back = target.read_kv_blocks(np.array(there[:used]))
    return {
        "state_shape": list(prefill.kv_cache_tensors()[0].shape),
        "geometry": prefill.kv_geometry().to_dict(),
        "kv_shape": list(kv.shape),
        "round_trip_equal": bool((back == kv).all()),
        "nonzero": bool(kv.abs().sum() > 0),
        "prefill_tokens": decode(prefill, settings, prompt, first, here, steps),
        "moved_tokens": decode(target, settings, prompt, first, there, steps),
    }


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(result))
