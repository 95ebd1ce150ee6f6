"""Environment variables and default locations of the compile cache."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from compile_cache.errors import StoreError

CACHE_URL_ENV = "VLLM_NEURON_CACHE_URL"
LOCAL_DIR_ENV = "VLLM_NEURON_CACHE_LOCAL_DIR"
LEASE_TTL_ENV = "VLLM_NEURON_CACHE_LEASE_TTL"
DEFAULT_LEASE_TTL = 120.0
SIGNING_KEY_ENV = "VLLM_NEURON_CACHE_SIGNING_KEY"
TRUSTED_KEYS_ENV = "VLLM_NEURON_CACHE_TRUSTED_KEYS"
ON_UNTRUSTED_ENV = "VLLM_NEURON_CACHE_ON_UNTRUSTED"

ENVIRONMENT_HELP = f"""\
environment:
  {CACHE_URL_ENV}      the store: a path, file:///path or s3://bucket/prefix
                             (default: $XDG_CACHE_HOME/vllm-neuron/compile-cache,
                             XDG_CACHE_HOME defaults to ~/.cache)
  {LOCAL_DIR_ENV}  where entries read from S3 are cached on this host
                             (default: the default local store above)
  {LEASE_TTL_ENV}  seconds an S3 compile lease lives without renewal before
                             another host may take it over (default {DEFAULT_LEASE_TTL:.0f})
  {SIGNING_KEY_ENV}  Ed25519 private key (PEM) this host signs entries with;
                             only hosts with one publish to S3 (`neuron-cache keygen`)
                             (default: this user's own key in
                             $XDG_CONFIG_HOME/vllm-neuron/compile-cache-key.pem, created
                             on first use, for local stores only)
  {TRUSTED_KEYS_ENV}  comma-separated public-key files whose signatures this
                             host accepts (the signing key's own half always is)
  {ON_UNTRUSTED_ENV}  what an entry without a trusted signature causes:
                             rebuild (default) or fail
  AWS_PROFILE, AWS_REGION, AWS_ACCESS_KEY_ID, ...  credentials for s3:// stores come
                             from the normal AWS chain (env, config files, instance role)
  AWS_ENDPOINT_URL_S3        an S3-compatible endpoint instead of AWS S3
"""


def user_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$XDG_CACHE_HOME, else ~/.cache (the XDG base-directory default)."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()


def user_config_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$XDG_CONFIG_HOME, else ~/.config (the XDG base-directory default)."""
    return Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()


def default_store_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The local store used when no URL is configured."""
    return user_cache_dir(environ) / "vllm-neuron" / "compile-cache"


def verified_copies_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where private verified copies of entries in shared stores are kept and reused
    (stores.verified_copy); this user's alone."""
    return user_cache_dir(environ) / "vllm-neuron" / "verified-copies"


def local_read_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where S3 entries are materialised on this host; by default the default local
    store, so entries pulled from S3 also serve this host when S3 is unreachable."""
    value = environ.get(LOCAL_DIR_ENV)
    return Path(value).expanduser() if value else default_store_dir(environ)


def lease_ttl(environ: Mapping[str, str] = os.environ) -> float:
    """The S3 lease lifetime in seconds, validated."""
    value = environ.get(LEASE_TTL_ENV)
    if not value:
        return DEFAULT_LEASE_TTL
    try:
        ttl = float(value)
    except ValueError:
        ttl = -1.0
    if not ttl > 0:
        raise StoreError(
            f"{LEASE_TTL_ENV}={value!r} must be a positive number of seconds, "
            f"e.g. {DEFAULT_LEASE_TTL:.0f}"
        )
    return ttl
