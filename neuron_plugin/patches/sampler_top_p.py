"""Patch `sampler-top-p`: the on-device nucleus keeps the token that crosses top_p.

NxDI's `Sampler._multinomial_sample` (0.7 to 0.9 alike; 0.9 ef2731e sampling.py lines
415-426) cuts the nucleus at `cumsum(probs) > top_p`: the token whose cumulative
probability crosses top_p is dropped. vLLM's sampler (and OpenAI's definition) keeps the
smallest set whose probability reaches top_p, so it keeps that token; a request with the
same parameters would sample from a different nucleus on the device than on the host (a
top_p of 0.7 over probabilities 0.5/0.3/0.2 keeps two tokens in vLLM and one in NxDI). The
fix cuts where the probability *before* a token already reaches top_p, as vLLM does, and
is otherwise NxDI's method: top-k of the global top-k, temperature, softmax, NxDI's
cumsum and multinomial draw. It is compiled into the graphs (the compile-cache key lists
the applied patches).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

from neuron_plugin.patches.base import NxDIModules, Patch, replace_method, unpatched

if TYPE_CHECKING:
    import torch

NAME = "sampler-top-p"


def vllm_nucleus_sample(
    sampler: Any,
    module: ModuleType,
    token_logits: Any,
    sampling_params: Any,
    return_values: bool,
    dim: int,
    rank_id: Any,
) -> Any:
    """NxDI's multinomial sample with vLLM's top-p cut (see the module docstring)."""
    import torch

    batch = token_logits.shape[0]
    shape = (batch, 1, 1) if token_logits.dim() == 3 else (batch, 1)
    top_k, top_p, temperature = (sampling_params[:, i].reshape(*shape) for i in range(3))
    values, indices = sampler._top_k_masked(token_logits, top_k, dim, rank_id)
    rows = values.shape[0]
    top_p, temperature = top_p[:rows, ...], temperature[:rows, ...]
    if sampler.is_medusa:
        return indices
    if sampler.dynamic or torch.any(temperature != 1.0):
        values = torch.divide(values, temperature)
    if sampler.dynamic or torch.any(top_p < 1.0):
        probs = sampler._soft_max(values, dim)
        before = (
            module.cumsum(tensor_in=probs, dim=dim, on_cpu=sampler.neuron_config.on_cpu) - probs
        )
        values = values.masked_fill_(
            torch.greater_equal(before, top_p), sampler.IGNORED_LOGITS_VALUE
        )
    probs = sampler._soft_max(values, dim)
    if return_values:
        return indices, probs
    counts = sampler._multinomial(probs, dim)
    return torch.gather(input=indices, dim=dim, index=counts).flatten()


def _stand_in(cls: type[torch.nn.Module]) -> Any:
    """A Sampler with the attributes _multinomial_sample reads (dynamic, CPU paths)."""
    import torch

    sampler = cls.__new__(cls)
    torch.nn.Module.__init__(sampler)
    config = SimpleNamespace(
        do_sample=False,
        dynamic=True,
        deterministic=True,
        global_topk=4,
        top_k_kernel_enabled=False,
        temperature=1.0,
        top_p=1.0,
        top_k=1,
    )
    attributes = {
        "neuron_config": SimpleNamespace(
            on_cpu=True,
            on_device_sampling_config=config,
            logical_nc_config=1,
            tp_degree=1,
            world_size=1,
        ),
        "on_device_sampling": True,
        "is_medusa": False,
        "do_sample": False,
        "dynamic": True,
        "deterministic": True,
        "global_topk": 4,
        "top_k_kernel_enabled": False,
        "IGNORED_LOGITS_VALUE": -3000,
        "process_group": None,
        "scales": True,
        "cuts_top_p": True,
    }
    for name, value in attributes.items():
        object.__setattr__(sampler, name, value)
    return sampler


def probe(modules: NxDIModules) -> str | None:
    """NxDI's nucleus of probabilities 0.5/0.3/0.2 at top_p 0.7: vLLM keeps two tokens."""
    import torch

    cls = getattr(modules.sampling, "Sampler", None)
    if cls is None or not hasattr(cls, "_multinomial_sample"):
        return None
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2), -50.0]])
    params = torch.tensor([[4.0, 0.7, 1.0]])
    run = unpatched(cls._multinomial_sample)
    _, probs = run(_stand_in(cls), logits, params, True, 1, None)
    if float(probs[0, 1]) > 1e-3:
        return None
    return (
        "the on-device sampler drops the token whose cumulative probability crosses "
        "top_p (vLLM keeps it)"
    )


def apply(modules: NxDIModules) -> bool:
    module = modules.sampling

    def make(original: Callable) -> Callable:
        def _multinomial_sample(self, token_logits, sampling_params, return_values, dim, rank_id):
            return vllm_nucleus_sample(
                self, module, token_logits, sampling_params, return_values, dim, rank_id
            )

        return _multinomial_sample

    return replace_method(module.Sampler, "_multinomial_sample", NAME, make)


PATCH = Patch(
    name=NAME,
    defect="on-device top-p drops the token that crosses top_p (vLLM keeps it)",
    probe=probe,
    apply=apply,
)
