"""Canonical manifests and the cache keys derived from them.

A manifest lists everything that changes the compiled graphs and nothing that does not:
two starts with equal manifests can share artifacts, and `diff_manifests` names the
fields that made a lookup miss. The plugin's own version is deliberately absent: a
plugin release that compiles the same graphs must keep hitting the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from compile_cache.errors import ManifestError, UnknownKey
from compile_cache.weights import weights_fingerprint

__all__ = [
    "KEY_LENGTH",
    "VOLATILE_MODEL_KEYS",
    "cache_key",
    "canonical_json",
    "check_key",
    "diff_manifests",
    "is_key",
    "make_manifest",
    "weights_fingerprint",
]

# Hugging Face config keys that never change a compiled graph: names and paths, library
# versions, token ids only the tokenizer and generation loop read, and switches for
# outputs the inference graphs do not produce. Dropped at every depth of the model
# config (multimodal configs nest sub-configs). `torch_dtype`/`dtype` move to the
# manifest's top-level `dtype`. `architectures` stays: it selects the model class.
VOLATILE_MODEL_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "unk_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
    }
)
_DTYPE_KEYS = ("torch_dtype", "dtype")
# Version keys that name this plugin; refused so a plugin release never changes keys.
_PLUGIN_VERSION_KEYS = frozenset(
    {"vllm-neuron-plugin", "vllm_neuron_plugin", "neuron_plugin", "neuron-plugin"}
)
# Keys are truncated sha256 digests: 128 bits keep collisions out of reach and folder
# names short; the full manifest stored with each entry is compared on every lookup.
KEY_LENGTH = 32
_KEY_RE = re.compile(f"[0-9a-f]{{{KEY_LENGTH}}}")


def make_manifest(
    *,
    backend: str,
    model_config: Mapping[str, Any],
    neuron_config: Mapping[str, Any],
    buckets: Mapping[str, Any],
    target: Mapping[str, Any],
    versions: Mapping[str, Any],
    compiler_flags: Sequence[str] = (),
    weights_fingerprint: str | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The canonical manifest of one compile: volatile model keys dropped, dtype recorded
    once, tuples turned into lists, keys sorted. Raises ManifestError naming the field
    when a value cannot be represented canonically in JSON."""
    if not isinstance(backend, str) or not backend:
        raise ManifestError(
            f"make_manifest(backend={backend!r}): the backend must be a "
            "non-empty name such as 'nxd' or 'reference'"
        )
    plugin_keys = sorted(_PLUGIN_VERSION_KEYS & set(versions))
    if plugin_keys:
        raise ManifestError(
            f"make_manifest(versions=...) contains {plugin_keys}: the "
            "plugin's own version must not be part of the cache key (a "
            "plugin release that compiles the same graphs must still hit); "
            "list only compiler, NxDI and runtime versions"
        )
    if isinstance(compiler_flags, str):
        raise ManifestError(
            f"make_manifest(compiler_flags={compiler_flags!r}): pass a "
            "list of flags, e.g. shlex.split(flags)"
        )
    if dtype is None:
        dtype = next((model_config[k] for k in _DTYPE_KEYS if model_config.get(k)), None)
    manifest = {
        "backend": backend,
        "model": _without_volatile(model_config),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "weights": weights_fingerprint,
        "neuron": neuron_config,
        "buckets": buckets,
        "target": target,
        "versions": versions,
        "compiler_flags": list(compiler_flags),
    }
    return _canonical(manifest, "manifest")


def canonical_json(manifest: Mapping[str, Any]) -> bytes:
    """The byte string a key is computed from: sorted keys, no whitespace, UTF-8."""
    return json.dumps(
        _canonical(manifest, "manifest"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def cache_key(manifest: Mapping[str, Any]) -> str:
    """The entry key: the first 32 hex digits of sha256(canonical_json(manifest))."""
    return hashlib.sha256(canonical_json(manifest)).hexdigest()[:KEY_LENGTH]


def is_key(name: object) -> bool:
    """Whether `name` is a well-formed cache key."""
    return isinstance(name, str) and _KEY_RE.fullmatch(name) is not None


def check_key(key: str) -> str:
    """Return `key` if it is a well-formed cache key; keys become folder and object
    names, so anything else is refused before it reaches a path."""
    if not is_key(key):
        raise UnknownKey(
            f"{key!r} is not a cache key: keys are {KEY_LENGTH} lowercase hex "
            "digits (see `neuron-cache ls`)"
        )
    return key


def diff_manifests(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Dotted paths of the fields that differ (present on one side only, or unequal);
    lists compare as a whole, so a changed bucket grid reads `buckets.context_encoding`."""
    return _diff(a, b, "")


def _diff(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            out.extend([sub] if key not in a or key not in b else _diff(a[key], b[key], sub))
        return out
    same = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    return [] if same else [path or "(whole manifest)"]


def _without_volatile(config: Any) -> Any:
    if isinstance(config, Mapping):
        return {k: _without_volatile(v) for k, v in config.items() if k not in VOLATILE_MODEL_KEYS}
    if isinstance(config, (list, tuple)):
        return [_without_volatile(v) for v in config]
    return config


def _canonical(value: Any, path: str) -> Any:
    """A JSON-only copy of `value` with sorted keys; refuses what JSON would distort."""
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ManifestError(
                f"{path} has non-string key {bad[0]!r}: JSON would turn it "
                "into a string silently; convert the keys to str first"
            )
        return {k: _canonical(value[k], f"{path}.{k}") for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise ManifestError(
            f"{path}={value!r} is not finite; JSON has no canonical form "
            "for it, use null or a string"
        )
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise ManifestError(
        f"{path}={value!r} has type {type(value).__name__}, which is not "
        "JSON-serialisable; convert it to str, int, float, bool, list or dict"
    )
