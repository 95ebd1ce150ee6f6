"""The compiled on-device sampler draws from the distribution vLLM's sampler draws from,
at Qwen3's 151,936-token vocabulary.

The sampler under test is `decoder.sample` as the reference backend runs it: exported
with torch.export, stored in the reference graph format and loaded back. The oracle is
vLLM's own code: the distribution its `Sampler` samples from (temperature, then
`apply_top_k_top_p`, then softmax) on the same fixed logits, and, for one setting, draws
from `Sampler` itself.

Tolerance: Pearson's chi-square goodness of fit over the tokens expected at least 5
times (the rest pooled), rejected at significance 0.001, and no token outside vLLM's
support (probability 0 after top-k/top-p) may be drawn at all. Draws use fixed seeds, so
the outcome is deterministic; the last test shows the criterion rejects a sampler that
ignores top-p or applies the temperature twice.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_plugin.backends.reference.sampler import sample
from neuron_plugin.backends.reference.graph_file import load_graph, save_graph
from neuron_plugin.core.sampling import DEFAULT_GLOBAL_TOPK, SamplingInputs
from neuron_plugin.validation.statistics import goodness_of_fit as agreement

VOCAB = 151_936
ROWS = 256          # rows per compiled call
DRAWS = 8 * ROWS    # draws per setting


class _Sampler(torch.nn.Module):
    def forward(self, logits, top_k, top_p, temperature, uniform):
        return sample(logits, top_k, top_p, temperature, uniform, DEFAULT_GLOBAL_TOPK)


@pytest.fixture(scope="module")
def device_sampler(tmp_path_factory):
    """The sampler compiled for [ROWS, VOCAB] the way a bucket's graph is stored."""
    greedy = SamplingInputs.greedy(ROWS)
    example = (torch.zeros(ROWS, VOCAB), *(torch.from_numpy(a) for a in (
        greedy.top_k, greedy.top_p, greedy.temperature, greedy.uniform[:, 0])))
    folder = tmp_path_factory.mktemp("sampler")
    save_graph(torch.export.export(_Sampler(), example), folder, "sampler")
    return load_graph(folder, "sampler")


def _logits(kind: str) -> torch.Tensor:
    """Fixed logits over the whole vocabulary."""
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(VOCAB, generator=g)
    if kind == "zipf":  # a power-law tail, as language models have
        return (-1.1 * torch.log(torch.arange(1, VOCAB + 1, dtype=torch.float32)))[order]
    if kind == "gaussian":
        return 2.5 * torch.randn(VOCAB, generator=g)
    near_ties = torch.randn(VOCAB, generator=g)  # eight close leaders
    near_ties[order[:8]] = 6.0 + 0.05 * torch.arange(8, dtype=torch.float32)
    return near_ties


def vllm_distribution(logits: torch.Tensor, temperature: float, top_k: int,
                      top_p: float) -> np.ndarray:
    """The probabilities vLLM's Sampler draws a random request's token from."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    scaled = (logits / temperature).unsqueeze(0)
    cut = apply_top_k_top_p_pytorch(scaled, torch.tensor([top_k]),
                                    torch.tensor([top_p]) if top_p < 1 else None,
                                    allow_cpu_sync=True)
    return torch.softmax(cut, dim=-1)[0].double().numpy()


def device_draws(sampler, logits: torch.Tensor, temperature: float, top_k: int,
                 top_p: float, seed: int, draws: int = DRAWS) -> np.ndarray:
    """Token counts of `draws` samples from the compiled sampler."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(VOCAB, dtype=np.int64)
    rows = logits.expand(ROWS, VOCAB)
    for _ in range(draws // ROWS):
        params = SamplingInputs.for_rows(
            np.full(ROWS, temperature, dtype=np.float32), np.full(ROWS, top_k),
            np.full(ROWS, top_p, dtype=np.float32), np.zeros(ROWS, dtype=bool),
            rng.random(ROWS, dtype=np.float32))
        tokens = sampler(rows, *(torch.from_numpy(a) for a in (
            params.top_k, params.top_p, params.temperature, params.uniform)))
        counts += np.bincount(tokens.numpy(), minlength=VOCAB)
    return counts


# (logits, temperature, top_k, top_p)
SETTINGS = [
    ("zipf", 0.7, 50, 0.9),
    ("gaussian", 1.3, 256, 0.8),
    ("near-ties", 1.0, 5, 1.0),
]


@pytest.mark.parametrize("kind,temperature,top_k,top_p", SETTINGS,
                         ids=[f"{s[0]}-T{s[1]}-k{s[2]}-p{s[3]}" for s in SETTINGS])
def test_device_frequencies_match_vllms_distribution(device_sampler, kind, temperature,
                                                     top_k, top_p):
    logits = _logits(kind)
    expected = vllm_distribution(logits, temperature, top_k, top_p)
    counts = device_draws(device_sampler, logits, temperature, top_k, top_p, seed=1)
    ok, why = agreement(counts, expected)
    assert ok, why
    assert np.count_nonzero(counts) > 1  # it samples, it does not just take the argmax


def test_vllms_sampler_draws_from_that_distribution():
    """The oracle above is what vLLM's Sampler itself draws (top-k setting: its fast
    path), as the plugin runs it for host rows (`HostRowsSampler`: vLLM's PyTorch paths
    on every vLLM build)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from neuron_plugin.serving.host_sampling import HostRowsSampler

    kind, temperature, top_k, top_p = SETTINGS[2]
    logits = _logits(kind)
    rows = 2 * ROWS
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), temperature), all_greedy=False, all_random=True,
        top_p=None, top_k=torch.full((rows,), top_k, dtype=torch.int32), generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    torch.manual_seed(3)
    sampler = HostRowsSampler("raw_logprobs")
    tokens = sampler(logits.expand(rows, VOCAB).clone(), metadata).sampled_token_ids
    ok, why = agreement(np.bincount(tokens[:, 0].numpy(), minlength=VOCAB),
                        vllm_distribution(logits, temperature, top_k, top_p))
    assert ok, why


def test_greedy_rows_equal_vllms_greedy_sampler(device_sampler):
    from neuron_plugin.serving.host_sampling import HostRowsSampler

    logits = 3 * torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(5))
    greedy = SamplingInputs.greedy(ROWS)
    tokens = device_sampler(logits, *(torch.from_numpy(a) for a in (
        greedy.top_k, greedy.top_p, greedy.temperature, greedy.uniform[:, 0])))
    assert torch.equal(tokens, HostRowsSampler.greedy_sample(logits.clone()))


@pytest.mark.parametrize("mutation", ["top_p ignored", "temperature applied twice"])
def test_the_criterion_rejects_a_wrong_sampler(device_sampler, mutation):
    kind, temperature, top_k, top_p = SETTINGS[0]
    logits = _logits(kind)
    expected = vllm_distribution(logits, temperature, top_k, top_p)
    if mutation == "top_p ignored":
        counts = device_draws(device_sampler, logits, temperature, top_k, 1.0, seed=2,
                              draws=2 * ROWS)
    else:
        counts = device_draws(device_sampler, logits, temperature ** 2, top_k, top_p,
                              seed=2, draws=2 * ROWS)
    ok, why = agreement(counts, expected)
    assert not ok, f"a sampler with {mutation} passed: {why}"
