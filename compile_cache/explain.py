"""Why a manifest misses: the nearest stored manifests and the fields that differ."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from compile_cache.manifest import diff_manifests


def nearest(
    manifest: Mapping[str, Any], candidates: Iterable[tuple[str, Mapping[str, Any]]], limit: int = 3
) -> list[tuple[str, list[str]]]:
    """(key, differing fields) of the `limit` candidates with the fewest differing
    fields; same-backend, same-model candidates first on ties."""
    ranked = []
    for key, other in candidates:
        differs = diff_manifests(manifest, other)
        same_model = other.get("model") == manifest.get("model")
        ranked.append((len(differs), not same_model, key, differs))
    ranked.sort()
    return [(key, differs) for _, _, key, differs in ranked[:limit]]


def miss_reason(key: str, store_url: str, ranked: list[tuple[str, list[str]]]) -> str:
    """One line for logs: the key that missed and what the nearest entry differs in."""
    if not ranked:
        return f"no entry for key {key}; the store {store_url} has no entries"
    near_key, differs = ranked[0]
    shown = ", ".join(differs[:6]) + (f" and {len(differs) - 6} more" if len(differs) > 6 else "")
    return f"no entry for key {key}; nearest entry {near_key} differs in {shown}"
