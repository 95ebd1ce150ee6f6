"""Run under an interpreter with NxD Inference (its CPU mode): the plugin's NxD backend on
real NxDI, counting the logits NxDI's graphs return per call and the logits that cross
the backend seam, for decode steps whose rows are all device-sampled and for steps with
a host-sampled row. Used by test_nxdi_cpu_mode.py (which resolves the settings: this
side has no vLLM); prints one JSON object.

    python nxdi_logits_probe.py SETTINGS_JSON MODEL_DIR HOST_ROW STEPS

Rows: 0 greedy, 1 and 2 sampled by NxDI's on-device sampler (compile with a
deterministic sampler for comparable runs), 3 greedy on the device or, with HOST_ROW=1,
sampled on the host (argmax of the logits the seam hands back) on every step."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronSettings

PROMPT_LENGTHS = (5, 17, 40, 3)
# (top_k, top_p, temperature) per row, in NxDI's encoding (top_k 1: greedy)
ROWS = ((1, 1.0, 1.0), (5, 0.9, 0.8), (8, 1.0, 1.2), (1, 1.0, 1.0))


def sampling(rows: list[int], host: list[bool]) -> SamplingInputs:
    values = [ROWS[r] for r in rows]
    return SamplingInputs(
        top_k=np.array([v[0] for v in values], dtype=np.int32),
        top_p=np.array([v[1] for v in values], dtype=np.float32),
        temperature=np.array([v[2] for v in values], dtype=np.float32),
        uniform=np.zeros((len(rows), 1), dtype=np.float32),
        needs_logits=np.array(host, dtype=bool),
    )


def spy_on_graphs(backend: NxDBackend, calls: list[dict[str, Any]]) -> None:
    """Record what each NxDI submodel's forward returns: tokens, and logits (float
    [rows, 1, vocab]); the CPU mode also returns the KV cache, which is not counted
    (on a device it stays there)."""
    vocab = backend.vocab_size
    for wrapper in backend.model.models:
        forward = wrapper.forward

        def spy(*args: Any, _forward: Any = forward, _tag: str = wrapper.tag, **kw: Any) -> Any:
            out = _forward(*args, **kw)
            tensors = out if isinstance(out, (list, tuple)) else [out]
            logits = [
                t for t in tensors if t.is_floating_point() and t.dim() == 3 and t.shape[-1] >= vocab
            ]
            calls.append(
                {
                    "tag": _tag,
                    "tokens_bytes": tensors[0].numel() * tensors[0].element_size(),
                    "logits_bytes": sum(t.numel() * t.element_size() for t in logits),
                }
            )
            return out

        wrapper.forward = spy


def main(settings_json: str, model_dir: str, host_row: bool, steps: int) -> dict[str, Any]:
    settings = NeuronSettings.from_dict(json.loads(settings_json))
    backend = NxDBackend(settings, model_dir)
    folder = Path(tempfile.mkdtemp())
    backend.compile(folder)
    backend.load(folder)
    calls: list[dict[str, Any]] = []
    spy_on_graphs(backend, calls)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, backend.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    block = settings.is_block_layout
    per_seq = settings.max_blocks_per_seq
    blocks = [[1 + per_seq * s + j for j in range(per_seq)] for s in range(4)]
    tokens: list[list[int]] = []
    report: dict[str, Any] = {"prefill": [], "decode": []}
    for seq, prompt in enumerate(prompts):
        inputs = context_encoding_inputs(
            settings, np.array(prompt), 0, seq, blocks[seq] if block else None
        )
        out = backend.run(inputs, sampling([seq], [False]))
        tokens.append([int(out.tokens[0, 0])])
        report["prefill"].append({**calls[-1], "seam_logits_bytes": out.logits.numpy().nbytes})
    host = [False, False, False, host_row]
    for _ in range(steps):
        positions = np.array([len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)])
        inputs = token_generation_inputs(
            settings,
            np.array([t[-1] for t in tokens]),
            positions,
            np.arange(4),
            blocks if block else None,
            logits=host_row,
        )
        out = backend.run(inputs, sampling([0, 1, 2, 3], host))
        step = out.tokens[:, 0].tolist()
        if host_row:  # the host samples row 3 (greedy) from the logits the seam carried
            step[3] = int(torch.argmax(out.logits[0]))
        for seq, token in enumerate(step):
            tokens[seq].append(int(token))
        report["decode"].append({**calls[-1], "seam_logits_bytes": out.logits.numpy().nbytes})
    report.update(prompts=prompts, tokens=tokens, vocab_size=backend.vocab_size)
    return report


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]))
    print(json.dumps(result))
