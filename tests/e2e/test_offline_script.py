"""vllm-neuron's offline example shape, unchanged: a script with no `if __name__ ==
"__main__":` guard builds `LLM(...)` at module level. Under spawn it would die in
multiprocessing's bootstrapping check; the platform starts its engine with fork instead
and says once how to add the guard. Greedy tokens still equal transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.e2e.support import corpus_token_ids

pytestmark = pytest.mark.engine

SCRIPT = """
import sys
from vllm import LLM, SamplingParams

prompt = [int(t) for t in sys.argv[2].split(",")]
llm = LLM(model=sys.argv[1], max_num_seqs=4, max_model_len=128, dtype="float32",
          enable_prefix_caching=False, enable_chunked_prefill=False)
output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8))
print("TOKENS", ",".join(map(str, output[0].outputs[0].token_ids)))
"""


def test_unguarded_offline_script_runs_and_says_how_to_guard(model_dirs, oracles, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    prompt = corpus_token_ids(model_dirs["llama"], 20)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    result = subprocess.run([sys.executable, str(script), str(model_dirs["llama"]),
                             ",".join(map(str, prompt))], capture_output=True, text=True,
                            env={**env, "VLLM_NEURON_BACKEND": "reference"}, timeout=300,
                            cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    tokens = next(l for l in result.stdout.splitlines() if l.startswith("TOKENS"))
    assert [int(t) for t in tokens.split()[1].split(",")] == oracles("llama").generate(prompt, 8)
    assert output.count('has no `if __name__ == "__main__":` guard') == 1
