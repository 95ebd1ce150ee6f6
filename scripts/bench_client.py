"""What the serving benchmarks share: a free loopback port, waiting for a server's
/health, one `vllm bench serve` run (vLLM's own load client) whose saved result is
returned, and one `neuron-buckets tune` run on a recorded trace."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float, name: str = "the server"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{name} was not healthy after {timeout:.0f} s")


def bench_serve(
    url: str,
    model: Path,
    result: Path,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prompts: int,
    request_rate: str = "inf",
    seed: int = 0,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`vllm bench serve` of random prompts (`ignore_eos`) against `url`, its result
    saved to `result` and returned."""
    vllm = str(Path(sys.executable).with_name("vllm"))
    subprocess.run(
        [
            vllm, "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--model", str(model), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(range_ratio), "--num-prompts", str(prompts),
            "--request-rate", request_rate, "--ignore-eos", "--seed", str(seed),
            "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name, *extra,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return dict(json.loads(result.read_text()))


def buckets_tune(trace: Path, output: Path, *options: str) -> dict[str, Any]:
    """`neuron-buckets tune TRACE *options --output OUTPUT` (the CLI a user runs on a
    recorded trace): the bucket set written to `output`, its summary returned (--json)."""
    cli = str(Path(sys.executable).with_name("neuron-buckets"))
    result = subprocess.run(
        [cli, "tune", str(trace), *options, "--json", "--output", str(output)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(result.stdout))
