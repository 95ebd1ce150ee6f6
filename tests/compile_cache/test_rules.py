"""The pure rules: store URLs and defaults, path safety, pruning plans, nearest entries,
and where neuronx-cc's per-graph cache goes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compile_cache.errors import StoreError, UnsafePathError
from compile_cache.explain import miss_reason, nearest
from compile_cache.neuronx_cc import compiler_cache_url, configure_compiler_cache
from compile_cache.paths import safe_relpath
from compile_cache.pruning import plan_prune
from compile_cache.settings import lease_ttl, local_read_cache_dir
from compile_cache.stores import LocalStore, S3Store, open_store, parse_store_url


def test_default_store_follows_xdg_cache_home(tmp_path):
    store = open_store(environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "vllm-neuron" / "compile-cache"
    assert local_read_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == store.root


def test_default_store_without_xdg_is_under_home_cache():
    assert open_store(environ={}).root == Path.home() / ".cache/vllm-neuron/compile-cache"


@pytest.mark.parametrize("url, parsed", [
    ("/var/cache/neuron", ("local", "/var/cache/neuron", "")),
    ("relative/dir", ("local", "relative/dir", "")),
    ("file:///var/cache/my%20neuron", ("local", "/var/cache/my neuron", "")),
    ("file://localhost/x", ("local", "/x", "")),
    ("s3://bucket", ("s3", "bucket", "")),
    ("s3://bucket/team/cache/", ("s3", "bucket", "team/cache")),
])
def test_store_urls(url, parsed):
    assert parse_store_url(url) == parsed


def test_an_argument_url_wins_over_the_environment(tmp_path):
    store = open_store(str(tmp_path / "arg"), environ={"VLLM_NEURON_CACHE_URL": "s3://b/p"})
    assert store.url == str(tmp_path / "arg")
    s3 = open_store(environ={"VLLM_NEURON_CACHE_URL": "s3://b/p"})
    assert isinstance(s3, S3Store) and s3.url == "s3://b/p"


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_lease_ttl_names_the_variable(value):
    with pytest.raises(StoreError, match=f"VLLM_NEURON_CACHE_LEASE_TTL={value!r}"):
        lease_ttl({"VLLM_NEURON_CACHE_LEASE_TTL": value})


@pytest.mark.parametrize("rel", ["a.neff", "graphs/ctx_128.neff", "deep/er/x.bin", "..a", "a.."])
def test_safe_relative_paths_pass(rel):
    assert safe_relpath(rel).as_posix() == rel


@pytest.mark.parametrize("rel", ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b",
                                 "a/", "a\\..\\b", "a\0b", ".."])
def test_paths_that_could_leave_an_entry_are_refused(rel):
    with pytest.raises(UnsafePathError):
        safe_relpath(rel)


@dataclass
class Use:
    key: str
    size: int
    last_used: float


@given(st.lists(st.tuples(st.integers(0, 1000), st.floats(0, 1000)), max_size=12),
       st.one_of(st.none(), st.integers(0, 5000)), st.one_of(st.none(), st.floats(0, 1000)))
def test_a_prune_plan_meets_both_limits_and_removes_least_recent_first(rows, max_size, max_age):
    entries = [Use(f"k{i}", size, used) for i, (size, used) in enumerate(rows)]
    doomed = set(plan_prune(entries, max_size_bytes=max_size, max_age_seconds=max_age,
                            now=1000.0))
    kept = [e for e in entries if e.key not in doomed]
    if max_size is not None:
        assert sum(e.size for e in kept) <= max_size
    if max_age is not None:
        assert all(1000.0 - e.last_used <= max_age for e in kept)
    # nothing kept is older than something removed to make room
    removed_for_size = [e for e in entries if e.key in doomed
                        and (max_age is None or 1000.0 - e.last_used <= max_age)]
    if removed_for_size and kept:
        assert max(e.last_used for e in removed_for_size) <= min(e.last_used for e in kept)
    if max_size is None and max_age is None:
        assert not doomed


def test_nearest_prefers_fewest_differences_then_the_same_model():
    base = {"model": {"a": 1}, "neuron": {"tp": 2, "bs": 4}, "dtype": "bf16"}
    candidates = [("far", {"model": {"a": 2}, "neuron": {"tp": 8, "bs": 1}, "dtype": "bf16"}),
                  ("other-model", {"model": {"a": 2}, "neuron": {"tp": 2, "bs": 4},
                                   "dtype": "bf16"}),
                  ("same-model", {"model": {"a": 1}, "neuron": {"tp": 2, "bs": 8},
                                  "dtype": "bf16"})]
    ranked = nearest(base, candidates, limit=2)
    assert ranked == [("same-model", ["neuron.bs"]), ("other-model", ["model.a"])]
    assert miss_reason("k", "/c", ranked) == \
        "no entry for key k; nearest entry same-model differs in neuron.bs"
    assert miss_reason("k", "/c", []) == "no entry for key k; the store /c has no entries"


def test_neuronx_cc_cache_goes_into_the_store(tmp_path):
    local = LocalStore(tmp_path / "cache")
    assert compiler_cache_url(local) == str(tmp_path / "cache" / "neuronx-cc")
    assert (tmp_path / "cache" / "neuronx-cc").is_dir()
    s3 = S3Store("bucket", "team/cache", local=local)
    assert compiler_cache_url(s3) == "s3://bucket/team/cache/neuronx-cc"
    environ: dict[str, str] = {}
    assert configure_compiler_cache(s3, environ) == "s3://bucket/team/cache/neuronx-cc"
    assert environ == {"NEURON_COMPILE_CACHE_URL": "s3://bucket/team/cache/neuronx-cc"}
    user_choice = {"NEURON_COMPILE_CACHE_URL": "/mnt/fast/neuron"}
    assert configure_compiler_cache(local, user_choice) == "/mnt/fast/neuron"


def test_the_package_imports_no_ml_stack_and_no_boto3_until_s3_is_used():
    code = ("import sys, compile_cache.cli, compile_cache.cache, compile_cache.transfer;"
            "bad = {'torch', 'vllm', 'neuronx_distributed_inference', 'neuron_plugin', 'boto3'}"
            " & set(sys.modules); print(sorted(bad))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"
