"""vLLM's `/v1/load_lora_adapter` answering an adapter this platform refused with HTTP
400 and the refusal's text, not 500.

vLLM 0.32's `OpenAIServingModels.load_lora_adapter` sends the adapter to the engine
(`add_lora`) and answers any error but its own not-found one with 500 "InternalServerError"
(vllm/entrypoints/openai/models/serving.py). The worker's refusals (`AdapterError`, from
`serving.adapter_files` and `serving.adapters`) are the client's: an adapter with the
wrong shapes, rank, modules or values. Each names the adapter as `LoRA adapter '<name>'`,
which is how this wrapper tells them from a server's failure (those stay 500). Installed
in vLLM's API server process only (where that module is loaded), once.
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from typing import Any

from neuron_plugin.patches.base import replace_method

MODULE = "vllm.entrypoints.openai.models.serving"
PATCH = "neuron_plugin.lora_refusals_are_client_errors"


def refusal_text(message: str, lora_name: str) -> str | None:
    """The refusal in an add_lora failure's text (vLLM prefixes "Call to add_lora method
    failed: "), or None when the failure is not one of this platform's refusals."""
    start = message.find(f"LoRA adapter {lora_name!r}")
    return None if start < 0 else message[start:]


def install() -> bool:
    """Wrap `load_lora_adapter` where vLLM's API server is loaded; whether it was."""
    serving = sys.modules.get(MODULE)
    if serving is None:
        return False
    from vllm.entrypoints.serve import create_error_response

    def make(load: Any) -> Any:
        async def load_lora_adapter(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = await load(self, request, *args, **kwargs)
            error = getattr(result, "error", None)
            if error is None or error.code != HTTPStatus.INTERNAL_SERVER_ERROR:
                return result
            text = refusal_text(error.message, request.lora_name)
            if text is None:
                return result
            return create_error_response(
                message=text, err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST
            )

        return load_lora_adapter

    replace_method(serving.OpenAIServingModels, "load_lora_adapter", PATCH, make)
    return True
