"""`kv_transfer_params`, the per-request dictionary vLLM's router carries between the
prefill and the decode server (vLLM's NIXL protocol, which `vllm-router
--vllm-pd-disaggregation` speaks). No vLLM import.

- to the prefill server: `{"do_remote_decode": true, ...}` (the router's NIXL fields
  are ignored): compute the prompt, keep its KV for a decode server;
- the prefill server's response: `{"do_remote_prefill": true, "do_remote_decode":
  false, "neuron_kv": {"format": 1, "key": <32 hex>, "num_tokens": <prompt length>}}`,
  which the router hands the decode server verbatim with the original request;
- the decode server loads the payload `neuron_kv.key` names and decodes.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARAMS_KEY = "neuron_kv"
PARAMS_FORMAT = 1


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request: keep its KV for a decode server."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """A decode request whose prompt a prefill server computed."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True


def new_key() -> str:
    """A payload's name: 128 random bits, so no request can name another's payload."""
    return uuid.uuid4().hex


def decode_params(key: str, num_tokens: int) -> dict[str, Any]:
    """What the prefill server answers for the decode server."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PARAMS_KEY: {"format": PARAMS_FORMAT, "key": key, "num_tokens": num_tokens},
    }


@dataclass(frozen=True)
class RemotePrefill:
    key: str
    num_tokens: int


def remote_prefill(params: Mapping[str, Any], prompt_len: int) -> RemotePrefill:
    """The payload a decode request names; ValueError saying what is wrong."""
    ref = params.get(PARAMS_KEY)
    if not isinstance(ref, Mapping):
        raise ValueError(
            f"kv_transfer_params has do_remote_prefill but no {PARAMS_KEY} object: the "
            f"prefill server does not run NeuronKVConnector (both servers need the same "
            f"--kv-transfer-config connector)"
        )
    if ref.get("format") != PARAMS_FORMAT:
        raise ValueError(
            f"kv_transfer_params.{PARAMS_KEY}.format={ref.get('format')!r}, expected "
            f"{PARAMS_FORMAT}: install the same vllm-neuron-plugin version on both servers"
        )
    key, num_tokens = ref.get("key"), ref.get("num_tokens")
    if not isinstance(key, str):
        raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.key={key!r} is not a string")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens != prompt_len:
        raise ValueError(
            f"kv_transfer_params.{PARAMS_KEY}.num_tokens={num_tokens!r} is not this "
            f"request's prompt length {prompt_len}: the decode request must carry the "
            f"prompt the prefill server encoded"
        )
    return RemotePrefill(key=key, num_tokens=num_tokens)
