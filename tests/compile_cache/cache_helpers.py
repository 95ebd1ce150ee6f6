"""Helpers shared by the compile-cache tests and their worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from compile_cache.manifest import make_manifest

WORKER = Path(__file__).with_name("worker.py")


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "_name_or_path": "/models/tiny-llama",
              "torch_dtype": "bfloat16", "transformers_version": "4.57.1", "eos_token_id": 2}


def manifest_for(**changes: Any) -> dict[str, Any]:
    """A realistic manifest of a tiny Llama on inf2; `changes` replace top-level args."""
    args: dict[str, Any] = dict(
        backend="nxd",
        model_config=TINY_LLAMA,
        neuron_config={"tp_degree": 2, "batch_size": 4, "seq_len": 2048,
                       "is_block_kv_layout": False},
        buckets={"context_encoding_buckets": [128, 256, 512, 1024, 2048],
                 "token_generation_buckets": [128, 256, 512, 1024, 2048]},
        target={"instance": "inf2", "logical_cores": 2},
        versions={"neuronx-cc": "2.21.33363.0", "neuronx-distributed-inference": "0.7.0"},
        compiler_flags=["--auto-cast=none", "-O1"],
    )
    args.update(changes)
    return make_manifest(**args)


def write_artifacts(folder: Path, tag: str = "") -> None:
    """What a compile writes: a few graphs in a subfolder and a config."""
    (folder / "graphs").mkdir()
    for bucket in (128, 256, 512):
        (folder / "graphs" / f"ctx_{bucket}.neff").write_bytes(
            f"neff {bucket} {tag}".encode() * 500)
    (folder / "neuron_config.json").write_text(json.dumps({"tag": tag}))


def counting_build(counter: Path, tag: str = ""):
    """A build that writes artifacts and appends a line to `counter` (see `builds`)."""
    def build(folder: Path) -> None:
        with counter.open("a") as f:
            f.write("built\n")
        write_artifacts(folder, tag)
    return build


def run_worker(*args: str, env: dict[str, str] | None = None,
               wait: bool = True) -> Any:
    """Run tests/compile_cache/worker.py in a new Python process."""
    cmd = [sys.executable, str(WORKER), *args]
    full_env = {**os.environ, **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def finish(proc: subprocess.Popen) -> dict[str, Any]:
    """The JSON result of a worker started with wait=False."""
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out)


def builds(counter: Path) -> list[str]:
    """One line per build that actually ran (workers append their pid)."""
    return counter.read_text().splitlines() if counter.exists() else []
