"""Torch threads for serving: how many intra-op threads each serving process gets, so
that together they never ask for more cores than the host gives them.

A multi-threaded torch op leaves its OpenMP workers spinning after each parallel region,
and a worker that waits for a core stalls every later region of the step: on this
project's 2-core machine, with other work on the cores, the plugin's engine at torch's
default (a thread per core) beside the API server served 60.7 output tokens/s at 32
concurrent requests, against 553.7 with one thread. vLLM's CPU platform has a rule for
its own processes ("Reducing Torch threads ... for serving", vllm.utils.torch_utils).

The rule (`serving_threads`), with C the cores this process may use (its CPU affinity,
capped by a cgroup CPU quota) and D the data-parallel engines on the host:
- one core is left to the API server, which gets 1 thread; each engine gets
  E = max(1, (C - 1) // D) cores;
- the process that computes gets E threads, or E - 1 where the backend runs in a
  runner process (the other process of the engine keeps 1 for its own host work): the
  one that computes the model on the host (the reference backend, or NxDI's CPU mode),
  or, with NxDI on NeuronCores, the engine core, which samples on the host;
- every other serving process gets 1.
An explicit OMP_NUM_THREADS is respected everywhere; VLLM_NEURON_TORCH_THREADS=N gives
the computing process N threads instead of its share (the others keep 1). Each process
applies its count after loading, so loading keeps torch's own count.

Pure (no vLLM): the backend runner applies it in the Neuron SDK's environment too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

THREADS_ENV = "VLLM_NEURON_TORCH_THREADS"
# vLLM's mark that it set OMP_NUM_THREADS itself for a worker (not the user's choice).
SET_BY_VLLM_ENV = "VLLM_OMP_NUM_THREADS_SET_BY_VLLM"
# vLLM's switch between an engine core process and one in the caller's process.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

API_SERVER = "API server"
ENGINE = "engine core"
RUNNER = "backend runner"


@dataclass(frozen=True)
class ThreadChoice:
    """A process's torch threads (None: leave torch's count alone) and why."""

    threads: int | None
    reason: str


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us / cpu.cfs_period_us`), None when there is none."""
    candidates = (
        (root / "cpu.max", None),
        (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"),
        (root / "cpu.cfs_quota_us", root / "cpu.cfs_period_us"),
    )
    for quota_file, period_file in candidates:
        try:
            text = quota_file.read_text().split()
            if period_file is None:
                quota, period = text[0], text[1]
            else:
                quota, period = text[0], period_file.read_text().split()[0]
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return max(int(quota) / int(period), 1.0)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup quota
    (os.cpu_count() sees neither)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, int(limit))
    return max(1, cores)


def _positive(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{name}={text!r} is not a whole number >= 1; set it to the torch threads "
            f"the process that computes the model should use, or unset it."
        )
    return value


def serving_threads(
    role: str,
    *,
    cores: int,
    engines: int = 1,
    model_on_host: bool = True,
    runner: bool = False,
    environ: Mapping[str, str] | None = None,
) -> ThreadChoice:
    """The torch threads of a serving process (see the module docstring). `role`: the
    API server, an engine core or a backend runner; `model_on_host`: the model runs on
    the host's CPUs (reference backend, NxDI's CPU mode), not on NeuronCores; `runner`:
    the backend runs in its own runner process."""
    env = os.environ if environ is None else environ
    given = env.get("OMP_NUM_THREADS")
    if given is not None and env.get(SET_BY_VLLM_ENV) != "1":
        return ThreadChoice(None, f"OMP_NUM_THREADS={given} is set, and kept")
    share = max(1, (cores - 1) // max(1, engines))
    # the model runs in the runner where there is one; host sampling in the engine core
    computes = role == (RUNNER if model_on_host and runner else ENGINE)
    own = env.get(THREADS_ENV, "").strip()
    if computes and own:
        return ThreadChoice(_positive(THREADS_ENV, own), f"{THREADS_ENV}={own}")
    where = f"{cores} cores: 1 for the API server, {share} per engine" + (
        f" of {engines}" if engines > 1 else ""
    )
    if not computes:
        what = "the API server" if role == API_SERVER else f"a {role} that does not compute"
        return ThreadChoice(1, f"{what}: 1 ({where})")
    threads = max(1, share - 1) if runner else share
    work = "the model" if model_on_host else "host sampling"
    other = RUNNER if role == ENGINE else ENGINE
    beside = f"; 1 kept for its {other}" if runner else ""
    return ThreadChoice(threads, f"{role} computing {work}: {threads} ({where}{beside})")


def model_on_host(backend: str, passthrough: Mapping[str, object]) -> bool:
    """Whether the model computes on the host's CPUs: the reference backend, or NxDI's
    CPU mode (`on_cpu`)."""
    return backend == "reference" or bool(passthrough.get("on_cpu"))


def apply_serving_threads(role: str, choice: ThreadChoice, log: Any) -> int:
    """Set this process's torch threads to `choice` (where it names a count) and log
    the count and why once; the count in force."""
    import torch

    if choice.threads is not None and torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    threads = torch.get_num_threads()
    log.info(
        "torch threads for serving, %s: %d (%s; %s or OMP_NUM_THREADS chooses another count)",
        role,
        threads,
        choice.reason,
        THREADS_ENV,
    )
    return threads


def serves_api(argv: Sequence[str], environ: Mapping[str, str], child: bool) -> bool:
    """Whether this process is `vllm serve`'s API server with its engine core in another
    process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING, on by default): the command's main
    process (`child`: started by another Python process, such as an engine core, which
    inherits the command line and resolves its settings again). An offline `LLM`
    script's own process is left alone: its torch code is the user's."""
    return (
        not child and list(argv[1:2]) == ["serve"] and environ.get(MULTIPROCESSING_ENV, "1") != "0"
    )
