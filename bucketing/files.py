"""Bucket sets as files: YAML or JSON holding the ``override_neuron_config`` keys that
vLLM-on-Neuron users already know, validated with errors naming file, key and fix.

    # where this set comes from
    description: "..."              # optional, free text
    context_encoding_buckets: [128, 256, 512, 1024, 2048]
    token_generation_buckets: [512, 1024, 2048]
    token_generation_batches: [1, 2, 4]
    prefix_buckets: [512, 1024, 2048]   # prefix 0 is always added; listing it is allowed

Every key is optional, but a file must hold at least one list.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import BucketError, BucketFileError
from .fileio import check_keys, dump_document, load_document
from .grids import validate_grid

KEYS = (
    "context_encoding_buckets",
    "token_generation_buckets",
    "prefix_buckets",
    "token_generation_batches",
)
METADATA = ("description",)


def load_bucket_set(
    path: str | Path,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    block_size: int | None = None,
) -> dict[str, list[int]]:
    """The file's bucket lists as override_neuron_config keys (only those present).

    With limits given, lengths must be <= max_model_len, batches <= max_num_seqs, and
    prefix buckets multiples of block_size (cache hits are whole KV blocks).
    """
    data = load_document(path)
    return _checked(path, data, max_model_len, max_num_seqs, block_size)


def dump_bucket_set(
    path: str | Path,
    *,
    context_encoding_buckets: Sequence[int] | None = None,
    token_generation_buckets: Sequence[int] | None = None,
    prefix_buckets: Sequence[int] | None = None,
    token_generation_batches: Sequence[int] | None = None,
    description: str = "",
    comment: str = "",
) -> Path:
    """Write a bucket set (validated first, so what this writes always loads); ``comment``
    becomes leading ``#`` lines in YAML."""
    lists = {
        "context_encoding_buckets": context_encoding_buckets,
        "token_generation_buckets": token_generation_buckets,
        "prefix_buckets": prefix_buckets,
        "token_generation_batches": token_generation_batches,
    }
    data: dict[str, Any] = {"description": description} if description else {}
    data.update({key: [int(v) for v in value] for key, value in lists.items() if value is not None})
    _checked(path, data, None, None, None)
    return dump_document(path, data, comment=comment)


def _checked(
    path: str | Path,
    data: dict[str, Any],
    max_model_len: int | None,
    max_num_seqs: int | None,
    block_size: int | None,
) -> dict[str, list[int]]:
    check_keys(path, data, KEYS + METADATA)
    if "description" in data and not isinstance(data["description"], str):
        raise BucketFileError(path, "description", f"must be text, got {data['description']!r}")
    result: dict[str, list[int]] = {}
    for key in KEYS:
        if key not in data:
            continue
        values = data[key]
        if key == "prefix_buckets" and isinstance(values, list):
            values = [v for v in values if v != 0]
        batches = key == "token_generation_batches"
        try:
            grid = validate_grid(
                values,
                name="the list",
                maximum=max_num_seqs if batches else max_model_len,
                limit_name="max_num_seqs" if batches else "max_model_len",
                align=block_size if key == "prefix_buckets" else None,
            )
        except BucketError as exc:
            raise BucketFileError(path, key, str(exc)) from None
        result[key] = list(grid)
    if not result:
        raise BucketFileError(
            path, None, f"holds no bucket list; add at least one of {', '.join(KEYS)}"
        )
    return result
