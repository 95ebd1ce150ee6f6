"""Stores by URL: a path or file:///path for a local directory, s3://bucket/prefix for S3.

`open_store()` with no URL reads VLLM_NEURON_CACHE_URL and falls back to the default
local directory, so the plugin and `neuron-cache` agree on the store without flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from compile_cache.errors import StoreError
from compile_cache.settings import CACHE_URL_ENV, default_store_dir, lease_ttl, local_read_cache_dir
from compile_cache.stores.base import Store
from compile_cache.stores.local import LocalStore
from compile_cache.stores.s3 import S3Store

__all__ = ["LocalStore", "S3Store", "Store", "open_store", "parse_store_url"]


def parse_store_url(url: str, source: str = "the store URL") -> tuple[str, str, str]:
    """("local", path, "") or ("s3", bucket, prefix); `source` names where the URL came
    from, for the error message."""
    parts = urlsplit(url)
    if not parts.scheme:
        return "local", url, ""
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreError(
                f"{source}={url!r}: file URLs name a local path, "
                "e.g. file:///var/cache/neuron (three slashes)"
            )
        return "local", unquote(parts.path), ""
    if parts.scheme == "s3":
        if not parts.netloc:
            raise StoreError(f"{source}={url!r} has no bucket: use s3://bucket/prefix")
        if parts.query or parts.fragment:
            raise StoreError(
                f"{source}={url!r}: s3 URLs take no ?query or #fragment; use s3://bucket/prefix"
            )
        return "s3", parts.netloc, parts.path.strip("/")
    raise StoreError(
        f"{source}={url!r}: unsupported scheme {parts.scheme!r}; use a path, "
        "file:///path or s3://bucket/prefix"
    )


def open_store(url: str | None = None, *, environ: Mapping[str, str] = os.environ) -> Store:
    """The store at `url`; None means $VLLM_NEURON_CACHE_URL, else the default local
    directory ($XDG_CACHE_HOME or ~/.cache, then vllm-neuron/compile-cache)."""
    source = "the store URL"
    if url is None:
        url, source = environ.get(CACHE_URL_ENV) or None, CACHE_URL_ENV
    if not url:
        return LocalStore(default_store_dir(environ))
    kind, location, prefix = parse_store_url(url, source)
    if kind == "local":
        return LocalStore(Path(location))
    return S3Store(
        location,
        prefix,
        local=LocalStore(local_read_cache_dir(environ)),
        lease_ttl=lease_ttl(environ),
    )
