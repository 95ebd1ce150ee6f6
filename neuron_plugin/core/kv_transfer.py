"""Prefill/decode disaggregation settings: which `--kv-transfer-config` this platform
serves, and the plugin connector's options. Pure: no vLLM import.

The one connector served is the plugin's own, `NeuronKVConnector`
(`neuron_plugin.kv_transfer.connector`, loaded through vLLM's `kv_connector_module_path`):
vLLM's connectors (NixlConnector, ExampleConnector, LMCache, ...) read and write KV
tensors of vLLM attention layers in the worker's process, and on Neuron the KV cache
lives in the compiled NxD graphs (in a runner process with the backend runner). The
plugin's connector moves a request's KV blocks through the backend contract
(`backends.kv_blocks`). It needs the block KV layout: in the contiguous layout a vLLM
block is a whole sequence line (block_size = max_model_len), so vLLM's scheduler could
account only whole lines of transferred KV.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuron_plugin.core.neuron_settings import BLOCK, KVTransferLimits

CONNECTOR = "NeuronKVConnector"
MODULE_PATH = "neuron_plugin.kv_transfer.connector"
# The default payload folder is this user's own (its uid in the name): a folder another
# local user created first at a shared name would otherwise keep the servers from
# starting (payload.prepare_folder refuses a folder of another user's).
DEFAULT_PATH_PREFIX = "/dev/shm/neuron-kv-"


def default_path() -> str:
    """This user's default payload folder, /dev/shm/neuron-kv-<uid>."""
    return f"{DEFAULT_PATH_PREFIX}{os.geteuid()}"


DEFAULT_TTL_S = 600.0
# The key that authenticates payloads between the servers of one deployment
# (kv_transfer.auth): the key itself, or a file holding it; neither: this user's own key.
KEY_ENV = "VLLM_NEURON_KV_KEY"
KEY_FILE_ENV = "VLLM_NEURON_KV_KEY_FILE"
OPTIONS = ("path", "ttl_s", "max_bytes")
EXAMPLE = (
    f'{{"kv_connector": "{CONNECTOR}", "kv_connector_module_path": "{MODULE_PATH}", '
    f'"kv_role": "kv_both", "kv_load_failure_policy": "recompute", '
    f'"kv_connector_extra_config": {{}}}}'
)


def connector_config(path: str, role: str = "kv_both", policy: str = "recompute") -> str:
    """The `--kv-transfer-config` JSON of the plugin's connector."""
    return json.dumps(
        {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": MODULE_PATH,
            "kv_role": role,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"path": path},
        }
    )


@dataclass(frozen=True)
class TransferOptions:
    """NeuronKVConnector's `kv_connector_extra_config`."""

    # The folder KV payloads are written to and read from: shared by the prefill and the
    # decode server (/dev/shm on one host; a shared file system across hosts).
    path: str = field(default_factory=default_path)
    # Payloads no decode server took (the client went away, the router failed) are
    # deleted after this many seconds.
    ttl_s: float = DEFAULT_TTL_S
    # The most bytes of payloads the folder may hold: a prefill server does not write a
    # payload past it (its decode server computes that prompt itself). None: half the
    # free space of the file system the folder is on when the server starts.
    max_bytes: int | None = None


def transfer_options(extra: Mapping[str, Any] | None) -> TransferOptions:
    """The connector's options from `kv_connector_extra_config`, each checked."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"--kv-transfer-config kv_connector_extra_config has unknown keys {unknown}: "
            f"{CONNECTOR} reads path (the payload folder), ttl_s and max_bytes; remove "
            f"the others."
        )
    path = extra.get("path", default_path())
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(
            f"--kv-transfer-config kv_connector_extra_config.path={path!r} must be an "
            f"absolute folder path shared by the prefill and decode servers, e.g. "
            f"{default_path()!r}."
        )
    ttl = extra.get("ttl_s", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
        raise ValueError(
            f"--kv-transfer-config kv_connector_extra_config.ttl_s={ttl!r} must be a "
            f"positive number of seconds (default {DEFAULT_TTL_S:g})."
        )
    max_bytes = extra.get("max_bytes")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise ValueError(
            f"--kv-transfer-config kv_connector_extra_config.max_bytes={max_bytes!r} must be "
            f"a positive number of bytes (default: half the free space of the payload "
            f"folder's file system at start)."
        )
    return TransferOptions(path=path, ttl_s=float(ttl), max_bytes=max_bytes)


def kv_transfer_problems(
    kv: KVTransferLimits | None, kv_layout: str, layout_reason: str, draft_model: str | None
) -> list[str]:
    """One message per reason this configuration cannot transfer KV (none without
    --kv-transfer-config)."""
    if kv is None or kv.connector is None:
        return []
    problems = []
    if kv.connector != CONNECTOR or kv.module_path != MODULE_PATH:
        given = json.dumps(
            {"kv_connector": kv.connector, "kv_connector_module_path": kv.module_path}
        )
        problems.append(
            f"--kv-transfer-config {given} is not supported on Neuron: vLLM's connectors "
            f"(NixlConnector, ExampleConnector, LMCache, ...) read and write the KV "
            f"tensors of vLLM attention layers in the worker's process, and here the KV "
            f"cache lives in the compiled NxD graphs (NixlConnector on a CPU-type "
            f"platform also pins the worker to one core per NUMA node); use the plugin's "
            f"connector: --kv-transfer-config '{EXAMPLE}'."
        )
    if kv_layout != BLOCK:
        problems.append(
            f"--kv-transfer-config needs the block KV layout, and this configuration uses "
            f"the {kv_layout} one ({layout_reason}): there a vLLM block is a whole "
            f"sequence line (block_size = max_model_len), so the decode server could take "
            f"KV only a whole line at a time; pass --enable-prefix-caching (or "
            f'override_neuron_config "is_block_kv_layout": true).'
        )
    if draft_model:
        problems.append(
            f"--kv-transfer-config with a draft model (--speculative-config model="
            f"{draft_model}): the draft's own KV cache is not transferred; serve the "
            f"disaggregated servers without it, or with method ngram."
        )
    try:
        transfer_options(kv.extra)
    except ValueError as exc:
        problems.append(str(exc))
    return problems
