"""Bucket grids: the generators, and the one validation every grid goes through.

A grid is the sorted tuple of static shapes a Neuron model is compiled for. 1-D grids
cover one length (context encoding: sequence length; token generation: context length;
chunked prefill: chunk size). 2-D grids are cross products: (batch, context length) for
token generation with batch bucketing, (active tokens, prefix length) for prefix caching.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from numbers import Integral

from .errors import BucketError

GENERATORS = ("nxdi", "geometric", "linear", "explicit", "chunk")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BucketError(
            f"{name} must be a positive integer, got {value!r}; pass a whole number >= 1"
        )
    return value


def _ordered_limits(min_length: object, max_length: object) -> tuple[int, int]:
    low = _positive_int("min_length", min_length)
    high = _positive_int("max_length", max_length)
    if low > high:
        raise BucketError(
            f"min_length {low} is above max_length {high}; lower min_length to at most {high}"
        )
    return low, high


def _round_log2(value: int) -> int:
    """round(log2(value)) in exact integer arithmetic (log2 of an integer is never k+0.5)."""
    floor = value.bit_length() - 1
    return floor + 1 if value * value >= 1 << (2 * floor + 1) else floor


def nxdi_buckets(min_length: int, max_length: int) -> list[int]:
    """NxDI's default grid (``autobucketing.generate_buckets``), so existing configs keep
    their meaning.

    Powers of two from 2**floor(log2(min_length)) up to but excluding
    2**round(log2(max_length)), then max_length. The rounding drops the power just below a
    maximum that is closer to the next power: max 2500 gives [128, 256, 512, 1024, 2500],
    no 2048. min_length == max_length (or a min above the max) gives [max_length], and a
    min_length that is not a power of two starts one power lower (min 200 -> 128), as
    in NxDI.
    """
    low = _positive_int("min_length", min_length).bit_length() - 1
    _positive_int("max_length", max_length)
    if min_length == max_length:
        return [max_length]
    return [1 << exponent for exponent in range(low, _round_log2(max_length))] + [max_length]


def geometric(min_length: int, max_length: int, ratio: float) -> list[int]:
    """min_length * ratio**i rounded up, then max_length: a constant worst-case padding
    fraction of about 1 - 1/ratio per bucket."""
    low, high = _ordered_limits(min_length, max_length)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not ratio > 1:
        raise BucketError(f"ratio must be a number above 1, got {ratio!r}; e.g. 1.5 or 2")
    values: list[int] = []
    step = 0
    while True:
        # The epsilon keeps 128 * 1.5**2 = 288.00000000000006 from rounding up to 289.
        value = math.ceil(low * ratio**step - 1e-9)
        if value >= high:
            return [*values, high]
        if not values or value > values[-1]:
            values.append(value)
        step += 1


def linear(min_length: int, max_length: int, step: int) -> list[int]:
    """min_length, min_length + step, ... below max_length, then max_length."""
    low, high = _ordered_limits(min_length, max_length)
    step = _positive_int("step", step)
    return [*list(range(low, high, step)), high]


def explicit(values: Iterable[int]) -> list[int]:
    """A hand-written list, sorted and de-duplicated; every entry a positive integer."""
    values = list(values)
    if not values:
        raise BucketError("an explicit grid needs at least one bucket; pass e.g. 128,512,2048")
    return sorted({_positive_int("bucket", value) for value in values})


def nxdi_chunk_sizes(tile: int, max_length: int) -> list[int]:
    """NxDI's chunked-prefill chunk sizes: at most three multiples of the attention
    q-tile (one tile, the median multiple, the last multiple covering max_length), so
    the chunk grid stays small when crossed with other dimensions."""
    tile = _positive_int("tile", tile)
    count = math.ceil(_positive_int("max_length", max_length) / tile)
    picks = sorted({0, (count - 1) // 2, count - 1})
    return [(index + 1) * tile for index in picks]


def align_up(values: Iterable[int], align: int) -> list[int]:
    """Every bucket rounded up to a multiple of ``align`` (e.g. the KV block size)."""
    align = _positive_int("align", align)
    return sorted({-(-value // align) * align for value in values})


def make_grid(
    generator: str,
    *,
    min_length: int = 128,
    max_length: int | None = None,
    ratio: float | None = None,
    step: int | None = None,
    values: Sequence[int] | None = None,
    tile: int | None = None,
    align: int | None = None,
) -> list[int]:
    """One entry point for every generator (the CLI and config files use it by name).

    ``align`` rounds generated buckets up to its multiples; an explicit list is checked
    instead, because silently changing a hand-written list would surprise its author.
    """
    if generator == "explicit":
        if values is None:
            raise BucketError("generator 'explicit' needs values; pass e.g. --buckets 128,2048")
        grid = explicit(values)
        return list(validate_grid(grid, name="explicit grid", align=align))
    if max_length is None:
        raise BucketError(
            f"generator {generator!r} needs max_length (e.g. max_model_len); pass --max"
        )
    builders = {
        "nxdi": lambda: nxdi_buckets(min_length, max_length),
        "geometric": lambda: geometric(min_length, max_length, 2 if ratio is None else ratio),
        "linear": lambda: linear(min_length, max_length, _required("linear", "step", step)),
        "chunk": lambda: nxdi_chunk_sizes(_required("chunk", "tile", tile), max_length),
    }
    if generator not in builders:
        raise BucketError(f"unknown generator {generator!r}; choose one of {', '.join(GENERATORS)}")
    if align and max_length % align:
        raise BucketError(
            f"max_length {max_length} is not a multiple of align {align}, so "
            f"an aligned grid cannot end at it; use {max_length // align * align} "
            f"or {-(-max_length // align) * align}"
        )
    grid = builders[generator]()
    return align_up(grid, align) if align else grid


def _required(generator: str, key: str, value: int | None) -> int:
    if value is None:
        raise BucketError(f"generator {generator!r} needs {key}; pass --{key}")
    return value


def validate_grid(
    values: object,
    *,
    name: str,
    maximum: int | None = None,
    covers: int | None = None,
    align: int | None = None,
    limit_name: str = "the maximum",
) -> tuple[int, ...]:
    """The grid as a tuple, or a BucketError naming ``name``, the bad value and the fix.

    Checks: a non-empty list of positive whole numbers, strictly increasing (sorted and
    unique: NxDI's bucket kernels assume order), every bucket <= ``maximum`` (a bucket
    above max_model_len could never be used), the largest >= ``covers`` when given (so
    every allowed request fits), every bucket a multiple of ``align`` when given (the KV
    block size for the block layout). The largest bucket need not equal ``maximum``: a
    smaller cap is allowed and longer requests are then rejected one by one.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise BucketError(
            f"{name} must be a list of bucket sizes, got {values!r}; write e.g. [128, 512, 2048]"
        )
    if not values:
        raise BucketError(f"{name} is empty; list at least one bucket, e.g. [128, 512, 2048]")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise BucketError(f"{name} has {value!r}; every bucket must be a whole number >= 1")
    values = [int(value) for value in values]
    for before, after in itertools.pairwise(values):
        if after == before:
            raise BucketError(f"{name} lists {after} twice; remove the duplicate")
        if after < before:
            raise BucketError(
                f"{name} is not sorted ({before} before {after}); write it in "
                f"increasing order: {sorted(set(values))}"
            )
    if maximum is not None and values[-1] > maximum:
        raise BucketError(
            f"{name} has {values[-1]}, above {limit_name} {maximum}; remove "
            f"buckets above {maximum} or raise {limit_name}"
        )
    if covers is not None and values[-1] < covers:
        raise BucketError(
            f"{name} tops out at {values[-1]} but must reach {covers}; add a bucket >= {covers}"
        )
    if align is not None:
        align = _positive_int("align", align)
        for value in values:
            if value % align:
                raise BucketError(
                    f"{name} has {value}, not a multiple of {align} (the KV "
                    f"block size); use {-(-value // align) * align} instead"
                )
    return tuple(values)


def prefix_grid(active: Sequence[int], prefixes: Sequence[int]) -> list[tuple[int, int]]:
    """(active tokens, prefix length) cross product for prefix caching, active-major.

    Prefix 0 is always included: a cache miss is a context encoding with no prefix, and
    NxDI adds that column for context encoding too.
    """
    actives = explicit(active)
    columns = sorted({0} | {_non_negative("prefix length", p) for p in prefixes})
    return [(a, p) for a in actives for p in columns]


def batch_grid(batches: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(batch size, context length) cross product for token generation with batch
    bucketing, batch-major."""
    return [(b, n) for b in explicit(batches) for n in explicit(lengths)]


def _non_negative(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BucketError(f"{name} must be a whole number >= 0, got {value!r}")
    return value
