"""`neuron-cache` run as a real console script in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compile_cache.cache import CompileCache
from compile_cache.stores import LocalStore
from compile_cache.units import format_size, parse_duration, parse_size

from .cache_helpers import manifest_for, write_artifacts

NEURON_CACHE = str(Path(sys.executable).with_name("neuron-cache"))
VERBS = ["ls", "show", "explain", "verify", "prune", "rm", "push", "pull", "compiler-cache"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([NEURON_CACHE, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def cli_json(*args: str, expect: int = 0, env: dict[str, str] | None = None):
    done = cli(*args, "--json", env=env)
    assert done.returncode == expect, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def filled(tmp_path) -> tuple[str, list[str]]:
    """A local store with two entries, built in this process."""
    store = LocalStore(tmp_path / "cache")
    cache = CompileCache(store)
    keys = [cache.get_or_build(manifest_for(neuron_config={"tp_degree": 2, "batch_size": b}),
                               write_artifacts).key for b in (1, 4)]
    return store.url, keys


@pytest.mark.parametrize("verb", [None, *VERBS])
def test_help_describes_the_environment_and_urls(verb):
    done = cli(*([verb] if verb else []), "--help")
    assert done.returncode == 0
    for needle in ("VLLM_NEURON_CACHE_URL", "VLLM_NEURON_CACHE_LOCAL_DIR", "s3://bucket/prefix",
                   "file:///", "XDG_CACHE_HOME", "AWS_ENDPOINT_URL_S3"):
        assert needle in done.stdout, (verb, needle)


def test_ls_lists_key_model_shapes_size_and_times(filled):
    url, keys = filled
    listed = cli_json("ls", "--store", url)
    assert sorted(e["key"] for e in listed) == sorted(keys)
    assert {"size", "created", "last_used", "manifest", "files"} <= set(listed[0])
    text = cli("ls", "--store", url).stdout.splitlines()
    assert text[0].split() == ["KEY", "MODEL", "SHAPES", "SIZE", "CREATED", "LAST", "USED"]
    assert any(keys[1] in line and "LlamaForCausalLM bfloat16 nxd" in line and "tp2 bs4" in line
               for line in text)


def test_ls_uses_the_store_from_the_environment(filled):
    url, keys = filled
    listed = cli_json("ls", env={"VLLM_NEURON_CACHE_URL": f"file://{url}"})
    assert sorted(e["key"] for e in listed) == sorted(keys)


def test_show_accepts_a_key_prefix(filled):
    url, keys = filled
    shown = cli_json("show", keys[0][:8], "--store", url)
    assert shown["key"] == keys[0]
    assert set(shown["file_digests"]) == {"graphs/ctx_128.neff", "graphs/ctx_256.neff",
                                          "graphs/ctx_512.neff", "neuron_config.json"}
    assert "manifest:" in cli("show", keys[0], "--store", url).stdout


def test_show_of_an_unknown_key_fails_with_a_hint(filled):
    url, _ = filled
    done = cli("show", "ffff", "--store", url)
    assert done.returncode == 2 and "neuron-cache ls" in done.stderr


def test_verify_passes_then_fails_and_quarantines_a_tampered_entry(filled):
    url, keys = filled
    assert all(r["ok"] for r in cli_json("verify", "--store", url))
    victim = Path(url) / "entries" / keys[0] / "files" / "graphs" / "ctx_128.neff"
    victim.write_bytes(victim.read_bytes()[:-1] + b"!")
    results = {r["key"]: r for r in cli_json("verify", "--store", url, expect=1)}
    assert results[keys[0]]["quarantined"] and "graphs/ctx_128.neff" in results[keys[0]]["problem"]
    assert results[keys[1]]["ok"]
    assert [e["key"] for e in cli_json("ls", "--store", url)] == [keys[1]]


def test_prune_by_size_and_rm(filled):
    url, keys = filled
    size = cli_json("ls", "--store", url)[0]["size"]
    dry = cli_json("prune", "--store", url, "--max-size", str(size), "--dry-run")
    assert len(dry["removed"]) == 1 and len(cli_json("ls", "--store", url)) == 2
    report = cli_json("prune", "--store", url, "--max-size", str(size), "--max-age", "30d")
    assert report["removed"] == dry["removed"]
    remaining = [e["key"] for e in cli_json("ls", "--store", url)]
    assert remaining == [k for k in keys if k not in report["removed"]]
    assert cli_json("rm", remaining[0], "--store", url) == {remaining[0]: True}
    assert cli_json("ls", "--store", url) == []


def test_explain_reports_a_hit_or_the_differing_fields(filled, tmp_path):
    url, keys = filled
    manifest_file = tmp_path / "m.json"
    manifest_file.write_text(json.dumps(manifest_for(neuron_config={"tp_degree": 2,
                                                                    "batch_size": 4})))
    assert cli_json("explain", str(manifest_file), "--store", url)["hit"]
    manifest_file.write_text(json.dumps(manifest_for(neuron_config={"tp_degree": 8,
                                                                    "batch_size": 4})))
    result = cli_json("explain", str(manifest_file), "--store", url, expect=1)
    assert result["nearest"][0] == {"key": keys[1], "differs": ["neuron.tp_degree"]}
    text = cli("explain", str(manifest_file), "--store", url).stdout
    assert text.startswith("miss: no entry for key") and "neuron.tp_degree" in text


def test_explain_of_an_unreadable_manifest_says_what_to_pass(tmp_path):
    done = cli("explain", str(tmp_path / "missing.json"), "--store", str(tmp_path))
    assert done.returncode == 2 and "precompile --dry-run" in done.stderr


def test_push_and_pull_through_s3(filled, s3_bucket, tmp_path):
    url, keys = filled
    remote = f"s3://{s3_bucket}/team"
    env = {"VLLM_NEURON_CACHE_LOCAL_DIR": str(tmp_path / "read-cache")}
    pushed = cli_json("push", url, remote, env=env)
    assert sorted(pushed["copied"]) == sorted(keys) and pushed["failed"] == {}
    assert sorted(e["key"] for e in cli_json("ls", "--store", remote, env=env)) == sorted(keys)
    pulled = cli_json("pull", remote, str(tmp_path / "fresh"), "--key", keys[0], env=env)
    assert pulled["copied"] == [keys[0]]
    default = cli_json("pull", remote, env={"VLLM_NEURON_CACHE_LOCAL_DIR":
                                            str(tmp_path / "prewarmed")})
    assert sorted(default["copied"]) == sorted(keys)
    assert sorted(LocalStore(tmp_path / "prewarmed").list_keys()) == sorted(keys)
    assert all(r["ok"] for r in cli_json("verify", "--store", remote, env=env))


def test_compiler_cache_points_into_the_store(tmp_path, s3_bucket):
    local = cli_json("compiler-cache", "--store", str(tmp_path / "c"))
    assert local == {"NEURON_COMPILE_CACHE_URL": str(tmp_path / "c" / "neuronx-cc")}
    assert (tmp_path / "c" / "neuronx-cc").is_dir()
    remote = cli_json("compiler-cache", "--store", f"s3://{s3_bucket}/p")
    assert remote == {"NEURON_COMPILE_CACHE_URL": f"s3://{s3_bucket}/p/neuronx-cc"}


@pytest.mark.parametrize("url, message", [
    ("gs://bucket/x", "unsupported scheme 'gs'"),
    ("s3:///prefix", "has no bucket"),
    ("file://otherhost/x", "three slashes"),
])
def test_bad_store_urls_name_the_setting_and_the_accepted_forms(url, message):
    done = cli("ls", env={"VLLM_NEURON_CACHE_URL": url})
    assert done.returncode == 2
    assert "VLLM_NEURON_CACHE_URL" in done.stderr and message in done.stderr


def test_bad_sizes_and_durations_are_explained():
    done = cli("prune", "--max-size", "lots")
    assert done.returncode == 2 and "e.g. 50G" in done.stderr
    assert parse_size("1.5G") == 3 << 29 and parse_size("512") == 512
    assert parse_size("10MiB") == 10 << 20 and parse_duration("2w") == 14 * 86400
    assert parse_duration("90") == 90 and format_size(3 << 29) == "1.5G"
    with pytest.raises(ValueError, match="e.g. 30d"):
        parse_duration("a fortnight")
