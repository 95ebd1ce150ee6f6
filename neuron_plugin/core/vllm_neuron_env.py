"""vllm-neuron's environment variables: each keeps its meaning here or is refused with
its replacement named, so a deployment moved from vllm-neuron never runs with a setting
silently dropped. Pure: the caller reads the variables (`NAMES`) and passes their values;
`core.settings.resolve_settings` raises the problems, `serving.vllm_settings.apply`
writes the updates.

`NEURON_COMPILED_ARTIFACTS` is where compiled graphs live. vllm-neuron loads whatever
that folder holds, keyed by nothing, so a changed configuration can load stale graphs.
Here it becomes the compile cache's local store (the cache's read cache on this host
when `VLLM_NEURON_CACHE_URL` is an S3 store): entries stay keyed by the configuration,
signed and verified before every load. `NEURON_ON_DEVICE_SAMPLING_DISABLED` belongs to
on-device sampling (`core.sampling`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from compile_cache.errors import StoreError
from compile_cache.settings import CACHE_URL_ENV, LOCAL_DIR_ENV
from compile_cache.stores import parse_store_url

COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"
FRAMEWORK_ENV = "VLLM_NEURON_FRAMEWORK"
NXDI_FRAMEWORK = "neuronx-distributed-inference"
SCHEDULER_ENV = "DISABLE_NEURON_CUSTOM_SCHEDULER"
QUANT_DTYPE_ENV = "NEURON_QUANT_DTYPE"
# Older vLLM Neuron bucket variables -> the override_neuron_config key that replaces them.
BUCKET_ENVS = {
    "NEURON_CONTEXT_LENGTH_BUCKETS": "context_encoding_buckets",
    "NEURON_TOKEN_GEN_BUCKETS": "token_generation_buckets",
}
# What NxDI's compiled-model folder holds (application_base.compile): a folder with
# these is vllm-neuron's artifacts, not a compile-cache store.
NXDI_ARTIFACT_FILES = ("neuron_config.json", "model.pt")
NAMES = (
    COMPILED_ARTIFACTS_ENV,
    FRAMEWORK_ENV,
    SCHEDULER_ENV,
    QUANT_DTYPE_ENV,
    CACHE_URL_ENV,
    LOCAL_DIR_ENV,
    *BUCKET_ENVS,
)


def _bucket_replacement(name: str, value: str) -> str:
    key = BUCKET_ENVS[name]
    try:
        buckets = [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        buckets = [128, 512, 2048]
    return (
        f"{name}={value!r} is not read: buckets are set in one place, "
        f"override_neuron_config.{key} (older vLLM read this variable for "
        f"transformers-neuronx only); pass --additional-config "
        f'\'{{"override_neuron_config": {{"{key}": {buckets}}}}}\' and unset {name}.'
    )


def _same_dir(a: str, b: str) -> bool:
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _artifact_store(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(variable to set, problem): which compile-cache variable NEURON_COMPILED_ARTIFACTS
    stands for, or why it cannot stand for one."""
    path = env.get(COMPILED_ARTIFACTS_ENV, "").strip()
    if not path:
        return None, None
    where = f"{COMPILED_ARTIFACTS_ENV}={path!r}"
    if "://" in path:
        return None, (
            f"{where} is a URL, but it names a local directory (as in "
            f"vllm-neuron); put a shared store in {CACHE_URL_ENV} "
            f"(s3://bucket/prefix) and point {COMPILED_ARTIFACTS_ENV} at a local "
            f"directory or unset it."
        )
    found = [f for f in NXDI_ARTIFACT_FILES if os.path.isfile(os.path.join(path, f))]
    if found:
        return None, (
            f"{where} holds NxDI artifacts compiled by vllm-neuron "
            f"({', '.join(found)}), which are not keyed by configuration nor "
            f"signed, so they are never loaded here; point "
            f"{COMPILED_ARTIFACTS_ENV} at an empty directory (it becomes the "
            f"compile cache's local store) or unset it."
        )
    url = env.get(CACHE_URL_ENV, "").strip()
    if not url:
        return CACHE_URL_ENV, None
    try:
        kind, location, _ = parse_store_url(url, CACHE_URL_ENV)
    except StoreError as exc:
        return None, f"{exc}."
    variable, current = (
        (LOCAL_DIR_ENV, env.get(LOCAL_DIR_ENV, "").strip())
        if kind == "s3"
        else (CACHE_URL_ENV, location)
    )
    if current and not _same_dir(current, path):
        return None, (
            f"{where} and {variable}={current!r} name two different local "
            f"stores of compiled graphs; set one of them (here "
            f"{COMPILED_ARTIFACTS_ENV} means {variable})."
        )
    return variable, None


def environment_problems(env: Mapping[str, str], *, enable_chunked_prefill: bool) -> list[str]:
    """Why vllm-neuron variables in `env` cannot work as set (empty: they all can)."""
    problems = []
    framework = env.get(FRAMEWORK_ENV, "").strip()
    if framework and framework.lower() != NXDI_FRAMEWORK:
        problems.append(
            f"{FRAMEWORK_ENV}={framework!r} is not supported: this plugin runs NxD Inference "
            f"only; set {FRAMEWORK_ENV}={NXDI_FRAMEWORK} or unset it (VLLM_NEURON_BACKEND "
            f"chooses between nxd and the CPU reference backend)."
        )
    scheduler = env.get(SCHEDULER_ENV, "").strip()
    if scheduler not in ("", "0", "1"):
        problems.append(f"{SCHEDULER_ENV}={scheduler!r} must be 0 or 1 (as in vllm-neuron).")
    elif scheduler == "1" and not enable_chunked_prefill:
        problems.append(
            f"{SCHEDULER_ENV}=1 asks for vLLM's own scheduler with chunked prefill; this "
            f"platform always uses vLLM's scheduler and turns chunked prefill on with a "
            f"flag: pass --enable-chunked-prefill (LLM: enable_chunked_prefill=True), or "
            f"unset {SCHEDULER_ENV}."
        )
    for name in BUCKET_ENVS:
        if env.get(name, "").strip():
            problems.append(_bucket_replacement(name, env[name]))
    if env.get(QUANT_DTYPE_ENV, "").strip():
        problems.append(
            f"{QUANT_DTYPE_ENV}={env[QUANT_DTYPE_ENV]!r} is not read: it quantized "
            f"transformers-neuronx weights; NxDI quantizes with override_neuron_config keys "
            f"quantized, quantization_dtype and quantized_checkpoints_path. Set those and "
            f"unset {QUANT_DTYPE_ENV}."
        )
    _, problem = _artifact_store(env)
    if problem:
        problems.append(problem)
    return problems


def environment_updates(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(variable, value, why) to set so the compile cache uses NEURON_COMPILED_ARTIFACTS
    (see the module docstring); engine processes started later inherit them."""
    variable, problem = _artifact_store(env)
    if variable is None or problem:
        return []
    role = "read cache of the S3 store" if variable == LOCAL_DIR_ENV else "local store"
    return [
        (
            variable,
            env[COMPILED_ARTIFACTS_ENV].strip(),
            f"{COMPILED_ARTIFACTS_ENV} is the compile cache's {role} here: entries keyed "
            f"by configuration, signed and verified before every load",
        )
    ]
