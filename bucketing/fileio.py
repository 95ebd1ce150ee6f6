"""Reading and writing the small YAML/JSON documents this package uses (bucket sets, cost
tables, histograms), with errors that name the file and the key."""

from __future__ import annotations

import json
from collections.abc import Mapping
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import yaml

from .errors import BucketFileError, did_you_mean

SUFFIXES = (".yaml", ".yml", ".json")
YAML_WIDTH = 1 << 16  # never fold a long description or list across lines


def load_document(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a .yaml/.yml/.json file (JSON is parsed as JSON so its
    errors carry JSON line numbers)."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise BucketFileError(
            path, None, f"unknown file type {path.suffix!r}; name it *.yaml, *.yml or *.json"
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise BucketFileError(
            path, None, f"cannot be read ({exc.strerror}); check the path"
        ) from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise BucketFileError(
            path, None, f"is not valid {path.suffix[1:].upper()}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise BucketFileError(
            path, None, f"must hold a mapping of keys at the top level, got {type(data).__name__}"
        )
    return data


def check_keys(
    path: str | Path,
    data: Mapping[str, Any],
    allowed: tuple[str, ...],
    required: tuple[str, ...] = (),
    where: str = "",
) -> None:
    """Reject unknown keys (with a did-you-mean) and missing required ones."""
    for key in data:
        if key not in allowed:
            hint = did_you_mean(str(key), allowed)
            raise BucketFileError(
                path, f"{where}{key}", f"unknown key{hint}; allowed keys: {', '.join(allowed)}"
            )
    for key in required:
        if key not in data:
            raise BucketFileError(path, f"{where}{key}", "is missing; it is required")


def whole_number(path: str | Path, key: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= minimum, or an error naming file and key."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise BucketFileError(path, key, f"must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def positive_number(path: str | Path, key: str, value: Any) -> float:
    """``value`` as a float > 0, or an error naming file and key."""
    if isinstance(value, bool) or not isinstance(value, Real) or not float(value) > 0:
        raise BucketFileError(path, key, f"must be a number > 0, got {value!r}")
    return float(value)


def dump_document(path: str | Path, data: Mapping[str, Any], comment: str = "") -> Path:
    """Write ``data`` as JSON (for .json) or YAML (``yaml.safe_dump``: block style, keys in
    the given order, lists of numbers on one line), preceded by ``comment`` lines when
    given (YAML only: JSON has no comments). Missing parent folders are created, so
    ``-o results/run1/x.yaml`` works."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise BucketFileError(path, None, "name the output *.yaml, *.yml or *.json")
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        header = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
        text = header + yaml.safe_dump(
            dict(data),
            sort_keys=False,
            default_flow_style=None,
            width=YAML_WIDTH,
            allow_unicode=True,
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise BucketFileError(
            path, None, f"cannot be written ({exc.strerror}); choose a writable path"
        ) from None
    return path
