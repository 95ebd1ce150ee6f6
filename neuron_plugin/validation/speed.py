"""Speed beside the physical floor: each compiled graph's p50 forward time and, for token
generation, the HBM roofline: a decode step reads every weight on its NeuronCore once
and the K/V of every position its bucket spans (batch x context length), so it cannot
take less than those bytes over the core's HBM bandwidth. The ratio p50 / roofline says
how far a bucket is from that floor. Context encoding is compute-bound: no roofline.
Pure arithmetic on timings, telemetry snapshots and the configuration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from neuron_plugin.core.inputs import TOKEN_GENERATION
from neuron_plugin.validation.report import BucketLatency, Speed


def roofline_ms(
    shape: Sequence[int], weight_bytes: int, kv_bytes_per_token: int, bytes_per_s: float
) -> float:
    """The least time a (batch, context length) decode step can take on one core."""
    batch, context = shape[0], shape[-1]
    return 1e3 * (weight_bytes + batch * context * kv_bytes_per_token) / bytes_per_s


def bucket_latencies(
    timings: Mapping[str, Sequence[tuple[tuple[int, ...], float]]],
    weight_bytes: int | None,
    kv_bytes_per_token: int,
    bytes_per_s: float | None,
) -> list[BucketLatency]:
    """Each timed graph (phase -> [(shape, median ms)]), token generation with its
    roofline where the instance's bandwidth and the weights' size are known."""
    rows = []
    for phase, shapes in timings.items():
        for shape, p50 in shapes:
            roof = None
            if phase == TOKEN_GENERATION and bytes_per_s and weight_bytes is not None:
                roof = roofline_ms(shape, weight_bytes, kv_bytes_per_token, bytes_per_s)
            rows.append(
                BucketLatency(
                    phase=phase,
                    shape=list(shape),
                    p50_ms=p50,
                    roofline_ms=roof,
                    ratio=p50 / roof if roof else None,
                )
            )
    return rows


def speed(rows: list[BucketLatency], bytes_per_s: float | None, backend: str) -> Speed:
    if bytes_per_s is None:
        note = (
            f"{backend} backend off an EC2 Neuron instance: p50 forward times of each "
            f"graph; no HBM roofline here"
        )
    else:
        note = (
            f"p50 forward time of each compiled graph; token generation beside its HBM "
            f"roofline at {bytes_per_s / 1e9:.0f} GB/s per NeuronCore"
        )
    return Speed(buckets=rows, hbm_bytes_per_s_per_core=bytes_per_s, note=note)


def decode_host_share(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
) -> float | None:
    """The host's share of the engine steps between two telemetry snapshots of one
    engine (serving.telemetry): step host time over host time plus the token-generation
    forward time; None without snapshots."""
    if after is None:
        return None

    def totals(snapshot: Mapping[str, Any] | None) -> tuple[float, float]:
        if snapshot is None:
            return 0.0, 0.0
        forward = sum(
            row["forward"]["sum"] for row in snapshot["buckets"] if row["phase"] == TOKEN_GENERATION
        )
        return snapshot["step_host"]["sum"], forward

    host_0, forward_0 = totals(before)
    host_1, forward_1 = totals(after)
    host, forward = host_1 - host_0, forward_1 - forward_0
    return host / (host + forward) if host + forward > 0 else None
