"""Decode steps through the real model runner and reference backend (the harness of
scripts/bench_sampling.py): with on-device sampling, a step whose rows the device samples
moves no logits at all, a mixed step moves only its host rows' logits; off, every row's."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

BATCH = 4
STEPS = 3


@pytest.fixture(scope="module", params=[True, False], ids=["on", "off"])
def engine(request, model_dirs, tmp_path_factory):
    from bench_sampling import engine_config
    from vllm.config import set_current_vllm_config

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model_dirs["llama"], BATCH, request.param, None)
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
        backend = open_backend(settings, model_dirs["llama"],
                               str(tmp_path_factory.mktemp("steps-cache")))
        yield config, settings, backend


@pytest.mark.parametrize("workload,host_rows_on", [("greedy", 0), ("sampled", 0),
                                                   ("mixed", 1)])
def test_only_host_rows_logits_cross_the_seam(engine, workload, host_rows_on):
    from bench_sampling import decode_steps

    config, settings, backend = engine
    row = decode_steps(config, settings, backend, workload, BATCH, STEPS)
    vocab = config.model_config.get_vocab_size()
    host_rows = host_rows_on if settings.on_device_sampling else BATCH
    assert row["logits_per_step"] == host_rows * vocab * 4
    assert row["tokens_per_step"] == (4 * BATCH if settings.on_device_sampling else 0)
