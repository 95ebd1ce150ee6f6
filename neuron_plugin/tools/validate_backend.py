"""`neuron-plugin validate`'s second half, on the backend alone once the engine is shut
down: the compile-cache key, each compiled graph's forward time beside the HBM roofline,
and KV blocks moved between two loaded backends where the configuration disaggregates
prefill and decode (the KV connector's path: read blocks from one backend's cache, write
them into another's, decode there)."""

from __future__ import annotations

from typing import Any

import numpy as np

from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.instances import INSTANCE_TYPES, detect_instance_type, lnc
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.validation.oracle_client import OracleProcess
from neuron_plugin.validation.report import CaseResult, Speed
from neuron_plugin.validation.speed import bucket_latencies, speed


def speed_report(
    settings: NeuronSettings,
    model: str,
    repeats: int,
    oracle: OracleProcess,
    vllm_config: Any,
    quick: bool,
    kv_transfer: bool,
    tolerance: float,
) -> tuple[Speed, str | None, list[CaseResult]]:
    """(speed, compile-cache key, the kv-transfer case's result where `kv_transfer`)."""
    from neuron_plugin.backends.loader import compile_configuration, open_backend
    from neuron_plugin.tools.measure import time_buckets

    key = compile_configuration(settings, model).key  # a hit: the engine compiled it
    backend = open_backend(settings, model)
    try:
        timings = time_buckets(backend, repeats=min(repeats, 3) if quick else repeats)
        results = []
        if kv_transfer and vllm_config.kv_transfer_config is None:
            results.append(
                CaseResult(
                    name="kv-transfer",
                    status="not-configured",
                    detail="no --kv-transfer-config; turn it on with --kv-transfer-config "
                    '\'{"kv_connector": "NeuronKVConnector", ...}\' to validate it',
                )
            )
        elif kv_transfer:
            results.append(kv_transfer_case(settings, model, backend, oracle, tolerance))
    finally:
        _close(backend)
    weights, kv_per_token = _bytes_per_core(settings, model)
    instance = detect_instance_type()
    bandwidth = INSTANCE_TYPES[instance].chip.bandwidth_per_core(lnc()) if instance else None
    rows = bucket_latencies(timings, weights, kv_per_token, bandwidth)
    return speed(rows, bandwidth, settings.backend), key, results


def _close(backend: Any) -> None:
    close = getattr(backend, "close", None)  # a runner process has one
    if close is not None:
        close()


def _bytes_per_core(settings: NeuronSettings, model: str) -> tuple[int | None, int]:
    """(the weights on one NeuronCore, K/V bytes of one token position on it)."""
    from neuron_plugin.core.checkpoint import read_hf_config
    from neuron_plugin.core.memory import checkpoint_parameters, estimate, kv_bytes_per_token
    from neuron_plugin.tools.explain import draft_of, quantized_of

    hf_config = read_hf_config(model)
    memory = estimate(
        settings,
        hf_config,
        checkpoint_parameters(model),
        1,
        draft_of(settings),
        quantized_of(settings, model),
    )
    weights = memory.weights_per_core_bytes
    if weights is not None and memory.draft_weights_per_core_bytes:
        weights += memory.draft_weights_per_core_bytes
    return weights, kv_bytes_per_token(hf_config, settings.dtype, settings.tp_degree)


def kv_transfer_case(
    settings: NeuronSettings, model: str, prefill: Any, oracle: OracleProcess, tolerance: float
) -> CaseResult:
    """Prefill a prompt on one backend, move its KV blocks into a second backend's cache
    (other block ids), decode there: the decoded token must be the first backend's and
    the oracle's."""
    from neuron_plugin.backends.loader import open_backend

    size = settings.block_size
    length = min(settings.max_model_len - 2, 2 * size + size // 2 + 1)
    blocks = -(-(length + 1) // size)
    if not settings.is_block_layout or settings.num_blocks <= 2 * blocks:
        return CaseResult(
            name="kv-transfer",
            status="refused",
            detail=f"KV blocks move in the block layout with room for "
            f"{2 * blocks} blocks; this one has {settings.num_blocks}",
        )
    from neuron_plugin.core.checkpoint import vocab_size

    prompt = np.random.default_rng(3).integers(0, vocab_size(model), length)
    ids_a = np.arange(1, blocks + 1)
    ids_b = np.arange(blocks + 1, 2 * blocks + 1)  # elsewhere in the second cache
    # A runner's answers are views of its shared arena, valid until its next call or its
    # end: each is copied at once.
    prefilled = prefill.forward(context_encoding_inputs(settings, prompt, 0, 0, ids_a.tolist()))
    first = int(prefilled[0].argmax())
    kv = prefill.read_kv_blocks(ids_a).clone()
    decoder = open_backend(settings, model)
    try:
        decoder.write_kv_blocks(ids_b, kv)
        step = (np.array([first]), np.array([length]), np.array([0]))
        moved, local = (
            backend.forward(token_generation_inputs(settings, *step, [ids.tolist()]))[0].clone()
            for backend, ids in ((decoder, ids_b), (prefill, ids_a))
        )
    finally:
        _close(decoder)
    gap = float((moved.log_softmax(-1) - local.log_softmax(-1)).abs().max())
    tokens = [first, int(moved.argmax())]
    score = oracle.ask(
        {"op": "score", "prompt": prompt.tolist(), "tokens": tokens, "adapter": None}
    )
    evidence = {
        "prompt_tokens": length,
        "blocks_moved": blocks,
        "logprob_gap": gap,
        "tokens": tokens,
    }
    problems = []
    if gap > tolerance:
        problems.append(
            f"the decode after the move differs from the same decode in place by "
            f"{gap:.3g} nats (tolerance {tolerance})"
        )
    if "error" in score:
        problems.append(f"the oracle failed: {score['error']}")
    elif any(
        t != a and b - c > tolerance
        for t, a, b, c in zip(tokens, score["argmax"], score["best"], score["chosen"], strict=True)
    ):
        problems.append(f"tokens {tokens}, the oracle's {score['argmax']}")
    if problems:
        return CaseResult(
            name="kv-transfer",
            status="fail",
            detail="; ".join(problems),
            evidence=evidence,
            inputs=[{"prompt": prompt.tolist(), "tokens": tokens}],
        )
    return CaseResult(
        name="kv-transfer",
        status="pass",
        evidence=evidence,
        detail=f"{blocks} KV blocks of a {length}-token prefill moved into a "
        f"second backend (other block ids); its decode equals the first's "
        f"and the oracle's",
    )
