"""prepare_sampling_params and validate_sampling_params as in NxDI 0.7."""

from typing import Union

import torch


def prepare_sampling_params(batch_size, top_k=[1], top_p=[1.0], temperature=[1.0]):
    top_k = prepare_tensor(top_k)
    top_p = prepare_tensor(top_p)
    temperature = prepare_tensor(temperature)

    assert (
        top_k.shape[0] == top_p.shape[0] == temperature.shape[0]
    ), f"sampling params shapes don't match. Got top_k shape: {top_k.shape}, top_p shape: {top_p.shape}, temperature shape: {temperature.shape}"

    if top_k.shape[0] == 1:
        top_k = top_k.broadcast_to(batch_size)
        top_p = top_p.broadcast_to(batch_size)
        temperature = temperature.broadcast_to(batch_size)
    return torch.stack([top_k, top_p, temperature], dim=1)


def prepare_tensor(val: Union[torch.Tensor, list, float]):
    if not torch.is_tensor(val):
        if not isinstance(val, list):
            val = [val]
        val = torch.tensor(val)
    return val


def validate_sampling_params(params: torch.Tensor, on_device_sampling_config) -> None:
    if params.shape[1] != 3:
        raise ValueError(f"Expected tensor of shape (batch_size, 3), but got {params.shape}")
    params = params.to(torch.float32)
    top_k, top_p, temperature = params[:, 0], params[:, 1], params[:, 2]
    global_top_k = on_device_sampling_config.global_topk
    valid_top_k = (top_k == -1) | ((top_k >= 0) & (top_k <= global_top_k))
    if not torch.all(valid_top_k):
        raise ValueError(
            f"Invalid top-k values found. top-k must be -1 or greater than 0 but less than "
            f"or equal to {global_top_k=}. Found {top_k=}.")
    if not torch.all((top_p > 0) & (top_p <= 1.0)):
        raise ValueError(f"Invalid top-p values found. Found {top_p=}.")
    if not torch.all(temperature > 0):
        raise ValueError(f"Invalid temperature values found. Found {temperature=}.")
