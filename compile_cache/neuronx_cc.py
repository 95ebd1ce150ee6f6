"""Pointing neuronx-cc's own per-graph cache into the store.

Entries of this cache hold a whole compiled configuration. neuronx-cc additionally
caches every graph it compiles under NEURON_COMPILE_CACHE_URL (a directory or an s3://
URL), keyed by the graph's HLO. Placing that cache next to the entries means a change of
one bucket misses the entry but recompiles only the one new graph, and a fleet sharing
an S3 store shares the per-graph cache too. That cache has its own format and locking;
this package neither verifies nor prunes it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from compile_cache.stores.base import Store

COMPILER_CACHE_ENV = "NEURON_COMPILE_CACHE_URL"
SUBFOLDER = "neuronx-cc"


def compiler_cache_url(store: Store) -> str:
    """`<root>/neuronx-cc` (created) for a local store, `s3://bucket/prefix/neuronx-cc`
    for an S3 store."""
    return store.child_url(SUBFOLDER)


def configure_compiler_cache(store: Store, environ: MutableMapping[str, str] = os.environ) -> str:
    """Set NEURON_COMPILE_CACHE_URL to the store's neuronx-cc area unless the user has
    set it; return the value in effect. Call before neuronx-cc is first imported."""
    if not environ.get(COMPILER_CACHE_ENV):
        environ[COMPILER_CACHE_ENV] = compiler_cache_url(store)
    return environ[COMPILER_CACHE_ENV]
