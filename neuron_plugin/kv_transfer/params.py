"""`kv_transfer_params`, the per-request dictionary vLLM's router carries between the
prefill and the decode server (vLLM's NIXL protocol, which `vllm-router
--vllm-pd-disaggregation` speaks). No vLLM import.

- to the prefill server: `{"do_remote_decode": true, ...}` (the router's NIXL fields
  are ignored): compute the prompt, keep its KV for a decode server;
- the prefill server's response: `{"do_remote_prefill": true, "do_remote_decode":
  false, "neuron_kv": {"format": 1, "key": <32 hex>, "num_tokens": <prompt length>}}`,
  which the router hands the decode server verbatim with the original request;
- the decode server loads the payload `neuron_kv.key` names and decodes.

One payload per request: a prefill request asks for one sequence (n = 1) and no stream
(a streamed answer carries no kv_transfer_params, so its payload would have no reader);
a decode request continues one sequence from it. `request_refusal` says why vLLM's API
server answers anything else with HTTP 400.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARAMS_KEY = "neuron_kv"
PARAMS_FORMAT = 1
FLAGS = ("do_remote_decode", "do_remote_prefill")
KEY = re.compile(r"[0-9a-f]{32}")


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
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise ValueError(
            f"kv_transfer_params.{PARAMS_KEY}.key={key!r} is not 32 lowercase hex digits: "
            f"kv_transfer_params must carry the key the prefill server returned, unchanged"
        )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens != prompt_len:
        raise ValueError(
            f"kv_transfer_params.{PARAMS_KEY}.num_tokens={num_tokens!r} is not this "
            f"request's prompt length {prompt_len}: the decode request must carry the "
            f"prompt the prefill server encoded"
        )
    return RemotePrefill(key=key, num_tokens=num_tokens)


def named_key(params: object) -> str | None:
    """The payload key a request's params name, whatever else is wrong with them (so
    the payload is deleted even when the params are refused); None if they name none."""
    ref = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
    key = ref.get("key") if isinstance(ref, Mapping) else None
    return key if isinstance(key, str) and KEY.fullmatch(key) else None


def request_refusal(params: object, prompt_len: int | None, n: int, streaming: bool) -> str | None:
    """Why a request's kv_transfer_params cannot be served (a client error), or None."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        return f"kv_transfer_params must be an object, got {type(params).__name__}"
    for flag in FLAGS:
        value = params.get(flag)
        if value is not None and not isinstance(value, bool):
            return f"kv_transfer_params.{flag}={value!r} must be true or false (a JSON boolean)"
    if wants_remote_decode(params):
        if n != 1:
            return (
                f"a prefill request (kv_transfer_params.do_remote_decode) asks for n={n} "
                f"sequences; its KV payload continues one: send n=1 (n requests for n "
                f"sequences)"
            )
        if streaming:
            return (
                "a prefill request (kv_transfer_params.do_remote_decode) cannot stream: the "
                "kv_transfer_params naming its KV payload come with the final, non-streamed "
                "answer; send stream=false (the router streams from the decode server)"
            )
    if wants_remote_prefill(params):
        if n != 1:
            return (
                f"a decode request (kv_transfer_params.do_remote_prefill) asks for n={n} "
                f"sequences from one KV payload, which one request takes; send n=1"
            )
        if prompt_len is not None:
            try:
                remote_prefill(params, prompt_len)
            except ValueError as exc:
                return str(exc)
    return None
