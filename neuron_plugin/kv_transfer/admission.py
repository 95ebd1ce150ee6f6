"""Which prefill/decode requests vLLM's API server admits (through the platform's
`validate_request`, before the engine sees them; a refusal is HTTP 400 with the reason).

- kv_transfer_params the connector cannot serve (`params.request_refusal`: flags that
  are not booleans, a prefill request with n > 1 or streaming, a decode request with
  n > 1 or params naming no payload of this prompt) are refused, and the payload they
  name is deleted then and there: nobody else will load it.
- With `kv_load_failure_policy: fail`, a decode request whose payload is not there or
  not this format (missing, expired, not a regular file, unsigned, another plugin
  version) is refused with that reason rather than vLLM's bare "Internal server error"
  for a load that fails in the engine. Only the payload's header is read here; the
  engine checks the rest when it loads it (a payload that fails there, e.g. a forged
  tag or NaN values, still ends the request with vLLM's 500, its reason in the log).
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind

from neuron_plugin.core.kv_transfer import transfer_options
from neuron_plugin.kv_transfer import payload
from neuron_plugin.kv_transfer.params import (
    named_key,
    remote_prefill,
    request_refusal,
    wants_remote_prefill,
)

PARAMETER = "kv_transfer_params"


def check_request(kv_config: Any, params: Any, prompt_len: int | None) -> None:
    """Raise VLLMValidationError (HTTP 400) for a request this server's connector
    cannot serve (module docstring); vLLM's KVTransferConfig, the SamplingParams."""
    extra = getattr(params, "extra_args", None) or {}
    kv_params = extra.get(PARAMETER)
    if kv_params is None:
        return
    folder = transfer_options(kv_config.kv_connector_extra_config).path
    streaming = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
    reason = request_refusal(kv_params, prompt_len, getattr(params, "n", 1), streaming)
    if (
        reason is None
        and prompt_len is not None
        and _fails_on_load_errors(kv_config)
        and wants_remote_prefill(kv_params)
    ):
        try:
            payload.check_available(folder, remote_prefill(kv_params, prompt_len).key, prompt_len)
        except payload.PayloadError as exc:
            reason = f"{exc} (kv_load_failure_policy fail; recompute serves it from the prompt)"
    if reason is None:
        return
    key = named_key(kv_params)
    if key is not None:
        payload.remove_payload(folder, key)
    raise VLLMValidationError(reason, parameter=PARAMETER, value=kv_params)


def _fails_on_load_errors(kv_config: Any) -> bool:
    return bool(kv_config.is_kv_consumer) and kv_config.kv_load_failure_policy == "fail"
