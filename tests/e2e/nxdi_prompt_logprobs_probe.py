"""Run under an interpreter with NxD Inference (its CPU mode): the plugin's NxD backend
on real NxDI scoring prompts (prompt logprobs, backends/nxd/prompt_graphs.py), each
prefilled in the given chunks into its own sequence, every call carrying its
positions' targets. Used by test_nxdi_prompt_logprobs.py (which resolves the settings:
this side has no vLLM); prints one JSON object.

    python nxdi_prompt_logprobs_probe.py SETTINGS_JSON MODEL_DIR PROMPTS_JSON CHUNK

PROMPTS_JSON: a list of token-id lists; CHUNK: the most tokens a call prefills."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.backends.nxd.prompt_graphs import prompt_answer
from neuron_plugin.core.inputs import context_encoding_inputs
from neuron_plugin.core.prompt_logprobs import prompt_targets
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronSettings


def main(settings_json: str, model_dir: str, prompts: list[list[int]], chunk: int) -> dict:
    settings = NeuronSettings.from_dict(json.loads(settings_json))
    backend = NxDBackend(settings, model_dir)
    folder = Path(tempfile.mkdtemp())
    backend.compile(folder)
    backend.load(folder)
    per_seq = settings.max_blocks_per_seq
    block = settings.is_block_layout
    report: dict[str, Any] = {"sequences": [], "graphs": [w.tag for w in backend.model.models]}
    for seq, prompt in enumerate(prompts):
        ids = np.array(prompt, dtype=np.int64)
        blocks = [1 + per_seq * seq + j for j in range(per_seq)] if block else None
        answers, calls, start = [], [], 0
        while start < len(ids):
            end = min(start + chunk, len(ids))
            inputs = context_encoding_inputs(settings, ids[:end], start, seq, blocks)
            width = inputs.input_ids.shape[1]
            targets = prompt_targets(ids, start, end - start, width)
            host = SamplingInputs.host_rows(1)
            out = backend.run(dataclasses.replace(inputs, prompt_targets=targets), host)
            assert out.prompt_logprobs is not None
            answers.append(out.prompt_logprobs)
            # the position of the graph's first row (NxDI's re-encoded prefix tail first)
            first = int(prompt_answer(backend.model)[-1][0, 0])
            calls.append({"bucket": list(inputs.bucket), "start": start, "first_row": first,
                          "answer_bytes": out.prompt_logprobs.nbytes()})
            start = end
        report["sequences"].append({
            "token_ids": np.concatenate([a.token_ids for a in answers]).tolist(),
            "logprobs": np.concatenate([a.logprobs for a in answers]).tolist(),
            "ranks": np.concatenate([a.ranks for a in answers]).tolist(),
            "calls": calls,
        })
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))))
