"""modules/generation/sampling.py: prepare_sampling_params, validate_sampling_params,
infer_sampling_params and the on-device Sampler, on its CPU (`on_cpu`) code paths.

The Sampler's semantics and method structure are NxDI's (identical in 0.7-0.9; read in
ef2731e, modules/generation/sampling.py Sampler): argmax over the logits, ignoring
sampling_params, unless do_sample or dynamic is set; otherwise (_multinomial_sample) per
row the top_k of the global_topk largest logits (_top_k_masked), divided by the
temperature and cut to top_p only when dynamic is set, keeping the tokens whose
*inclusive* cumulative probability is at most top_p (the token that crosses top_p is
dropped; the first token is always kept), then a multinomial draw (_multinomial) whose
uniform number is 0.5 when deterministic. Without dynamic, `torch.any(temperature != 1.0)` is decided when the
graph is traced, on the example inputs of ModelWrapper.input_generator (the config's
temperature/top_p with do_sample, else 1), so it is decided once here too."""

from typing import Union

import torch

IGNORED_LOGITS_VALUE = -3000  # Sampler.IGNORED_LOGITS_VALUE


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
    if not torch.equal(top_k, top_k.floor()):
        raise ValueError(f"Invalid top-k values found. Found {top_k=}.")
    if not torch.all((top_p > 0.0) & (top_p <= 1.0)):
        raise ValueError(f"Invalid top-p values found. Found {top_p=}.")
    if not torch.all(temperature >= 0.0):
        raise ValueError(f"Invalid temperature values found. Found {temperature=}.")
    if torch.any((temperature == 0.0) & ((top_k == -1) | (top_k == 0))):
        raise ValueError("Invalid sampling parameters found. Temperature = 0 enables greedy "
                         "sampling. Please set top_k to 1")


def infer_sampling_params(params: torch.Tensor):
    for i in range(params.shape[0]):
        if params[i, 2] == 0:
            params[i, 0] = 1
            params[i, 1] = 1
    return params


def cumsum(tensor_in, dim, on_cpu=False):
    """sampling.cumsum: torch.cumsum on the CPU (NKI or a matmul on Neuron)."""
    return torch.cumsum(tensor_in, dim=dim)


class Sampler(torch.nn.Module):
    """Sampler(neuron_config): built at trace time, so do_sample/dynamic/deterministic
    are compiled into each graph."""

    IGNORED_LOGITS_VALUE = IGNORED_LOGITS_VALUE

    def __init__(self, neuron_config, do_sample=None):
        super().__init__()
        config = neuron_config.on_device_sampling_config
        self.neuron_config = neuron_config
        self.is_medusa = False
        self.do_sample = config.do_sample if do_sample is None else do_sample
        self.dynamic = config.dynamic
        self.deterministic = config.deterministic
        self.global_topk = config.global_topk
        traced = config if self.do_sample else None
        # `torch.any(temperature != 1.0)` / `torch.any(top_p < 1.0)` are decided at trace
        # time on the example inputs (the config's values with do_sample, else 1).
        self.scales = self.dynamic or (traced is not None and traced.temperature != 1.0)
        self.cuts_top_p = self.dynamic or (traced is not None and traced.top_p < 1.0)

    def _soft_max(self, logits, dim):
        return torch.nn.functional.softmax(input=logits, dim=dim)

    def _top_k_masked(self, logits, top_k, dim, rank_id):
        if self.global_topk > 0:
            sorted_logits, indices = torch.topk(input=logits, k=self.global_topk, dim=dim)
        else:
            sorted_logits, indices = torch.sort(input=logits, dim=dim, descending=True)
        mask = torch.arange(sorted_logits.shape[-1]).broadcast_to(*sorted_logits.shape)
        return sorted_logits.masked_fill_(torch.greater_equal(mask, top_k),
                                          self.IGNORED_LOGITS_VALUE), indices

    def _rand_selector(self, probs_cumsum, num_samples=1):
        shape = (probs_cumsum.shape[0], num_samples)
        if self.deterministic:
            return torch.full(shape, 0.5)
        return torch.rand_like(torch.zeros(shape, dtype=probs_cumsum.dtype))

    def _multinomial(self, probs, dim, num_samples=1):
        probs_cumsum = cumsum(tensor_in=probs, dim=dim, on_cpu=True)
        probs_cumsum = probs_cumsum / probs_cumsum[..., -1:]
        probs_cumsum[..., -1:] = 1
        rand_selector = self._rand_selector(probs_cumsum, num_samples)
        return torch.sum(torch.greater(rand_selector, probs_cumsum), dim=dim).unsqueeze(dim)

    def _multinomial_sample(self, token_logits, sampling_params, return_values, dim, rank_id):
        batch_size = token_logits.shape[0]
        top_k = sampling_params[:, 0].reshape(batch_size, 1)
        top_p = sampling_params[:, 1].reshape(batch_size, 1)
        temperature = sampling_params[:, 2].reshape(batch_size, 1)
        values, indices = self._top_k_masked(token_logits, top_k, dim, rank_id)
        if self.scales:
            values = torch.divide(values, temperature)
        if self.cuts_top_p:
            probs_cumsum = cumsum(tensor_in=self._soft_max(values, dim), dim=dim, on_cpu=True)
            top_p = torch.max(torch.min(probs_cumsum), top_p)
            top_p_mask = torch.greater(probs_cumsum, top_p).index_fill_(
                dim, torch.tensor([0]), False)
            values = values.masked_fill_(top_p_mask, self.IGNORED_LOGITS_VALUE)
        probs = self._soft_max(values, dim)
        if return_values:
            return indices, probs
        counts = self._multinomial(probs, dim)
        return torch.gather(input=indices, dim=dim, index=counts).flatten()

    def forward(self, token_logits, sampling_params, return_values=False, rank_id=None):
        dim = len(token_logits.shape) - 1
        if self.do_sample or self.dynamic:
            return self._multinomial_sample(token_logits, sampling_params, return_values,
                                            dim, rank_id)
        return torch.argmax(token_logits, dim=dim)
