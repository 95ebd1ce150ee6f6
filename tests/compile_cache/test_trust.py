"""Signed entries: what a store writer cannot forge. Real keys, real files, a real S3
API server; every refusal is shown to leave the refused bytes unused."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from compile_cache.cache import CompileCache
from compile_cache.errors import EntryCorrupt, EntryUntrusted
from compile_cache.manifest import cache_key
from compile_cache.record import new_record
from compile_cache.settings import verified_copies_dir
from compile_cache.signing import Trust, TrustConfigError, generate_key, key_id, own_key_path
from compile_cache.stores import LocalStore, S3Store
from compile_cache.transfer import pull, push

from .cache_helpers import builds, counting_build, manifest_for, write_artifacts


def forge(store: LocalStore, key: str, payload: bytes, trust: Trust | None = None) -> None:
    """What a writer of the store can do: replace a file and rewrite the record's
    digests to match, signed with `trust` (None: unsigned)."""
    files = store.files_path(key)
    (files / "neuron_config.json").write_bytes(payload)
    record = new_record(json.loads((files.parent / "entry.json").read_text())["manifest"],
                        files)
    if trust is not None:
        record = trust.sign(record)
    (files.parent / "entry.json").write_bytes(record.to_json())


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "cache")


def test_a_local_cache_signs_with_the_users_own_key_without_set_up(store, tmp_path):
    built = CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    own = own_key_path()
    assert stat.S_IMODE(own.stat().st_mode) == 0o600 and own.with_suffix(".pem.pub").exists()
    record = store.get_record(built.key)
    assert record.signature.key_id == Trust.from_env().signer_id
    assert CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c")).hit
    assert CompileCache(store).verify()[0].ok and builds(tmp_path / "c") == ["built"]


@pytest.mark.parametrize("signer, problem", [
    (None, "record is not signed"),
    ("attacker", "which this host does not trust"),
])
def test_rewritten_digests_are_refused_and_rebuilt(store, tmp_path, signer, problem):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c", "v1"))
    attacker = None
    if signer:
        generate_key(tmp_path / "attacker.pem")
        attacker = Trust(signing_key=tmp_path / "attacker.pem", own_key=tmp_path / "none")
    forge(store, built.key, b"payload", attacker)
    verified = cache.verify()
    assert not verified[0].ok and problem in verified[0].problem and verified[0].quarantined
    forge_again = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c", "v2"))
    assert not forge_again.hit and builds(tmp_path / "c") == ["built", "built"]
    assert b"payload" not in (forge_again.path / "neuron_config.json").read_bytes()


def test_a_signed_record_altered_after_signing_is_refused(store, tmp_path):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    entry = store.files_path(built.key).parent / "entry.json"
    raw = json.loads(entry.read_text())
    (store.files_path(built.key) / "neuron_config.json").write_bytes(b"payload")
    forged = new_record(raw["manifest"], store.files_path(built.key))
    raw["files"]["neuron_config.json"] = {"sha256": forged.files["neuron_config.json"].sha256,
                                          "size": len(b"payload")}
    entry.write_text(json.dumps(raw))  # the old signature kept
    result = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not result.hit
    assert "does not match its content: it was altered after signing" in result.reason


def test_the_fail_policy_refuses_to_start_and_builds_nothing(store, tmp_path, monkeypatch):
    built = CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    forge(store, built.key, b"payload")
    monkeypatch.setenv("VLLM_NEURON_CACHE_ON_UNTRUSTED", "fail")
    with pytest.raises(EntryUntrusted, match="VLLM_NEURON_CACHE_ON_UNTRUSTED=fail"):
        CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert builds(tmp_path / "c") == ["built"]
    assert store.get_record(built.key) is not None  # left for inspection


@pytest.mark.parametrize("variable, value, message", [
    ("VLLM_NEURON_CACHE_SIGNING_KEY", "/nonexistent/key.pem", "neuron-cache keygen"),
    ("VLLM_NEURON_CACHE_TRUSTED_KEYS", "/nonexistent/fleet.pub", "public-key files"),
    ("VLLM_NEURON_CACHE_ON_UNTRUSTED", "ignore", "'rebuild'"),
])
def test_bad_trust_settings_name_the_variable_and_the_fix(variable, value, message):
    with pytest.raises(TrustConfigError, match=f"{variable}.*{message}"):
        Trust.from_env({variable: value})


def test_trusted_keys_accept_pem_and_openssh_public_keys(tmp_path, fleet_key):
    from cryptography.hazmat.primitives import serialization

    public = serialization.load_pem_public_key(Path(f"{fleet_key}.pub").read_bytes())
    ssh = tmp_path / "fleet.ssh.pub"
    ssh.write_bytes(public.public_bytes(serialization.Encoding.OpenSSH,
                                        serialization.PublicFormat.OpenSSH))
    for path in (Path(f"{fleet_key}.pub"), ssh):
        trust = Trust.from_env({"VLLM_NEURON_CACHE_TRUSTED_KEYS": f" {path} ,",
                                "XDG_CONFIG_HOME": str(tmp_path / "cfg")})
        assert trust.trusted_ids() == [key_id(public)]


def s3_store(bucket: str, local: Path) -> S3Store:
    return S3Store(bucket, "fleet", local=LocalStore(local))


def test_a_serving_host_loads_fleet_entries_and_never_publishes(s3_bucket, fleet_key,
                                                                tmp_path, monkeypatch):
    built = CompileCache(s3_store(s3_bucket, tmp_path / "compile-host")).get_or_build(
        manifest_for(), counting_build(tmp_path / "c"))
    monkeypatch.delenv("VLLM_NEURON_CACHE_SIGNING_KEY")
    monkeypatch.setenv("VLLM_NEURON_CACHE_TRUSTED_KEYS", f"{fleet_key}.pub")
    serving = CompileCache(s3_store(s3_bucket, tmp_path / "serving-host"))
    assert serving.get_or_build(manifest_for(), counting_build(tmp_path / "c")).hit

    other = manifest_for(dtype="float32")
    result = serving.get_or_build(other, counting_build(tmp_path / "c"))
    assert not result.hit and "does not publish" in result.reason
    assert result.path.is_relative_to(tmp_path / "serving-host")
    names = [o["Key"] for o in boto3.client("s3").list_objects_v2(
        Bucket=s3_bucket).get("Contents", [])]
    assert not any(cache_key(other) in n for n in names)
    again = serving.get_or_build(other, counting_build(tmp_path / "c"))
    assert again.hit and "built earlier by this host" in again.reason
    assert len(builds(tmp_path / "c")) == 2 and built.key != result.key


def test_a_serving_host_refuses_an_untrusted_s3_entry_and_leaves_it(s3_bucket, fleet_key,
                                                                   tmp_path, monkeypatch):
    attacker_key = tmp_path / "attacker.pem"
    generate_key(attacker_key)
    monkeypatch.setenv("VLLM_NEURON_CACHE_SIGNING_KEY", str(attacker_key))
    CompileCache(s3_store(s3_bucket, tmp_path / "attacker")).get_or_build(
        manifest_for(), counting_build(tmp_path / "attacker-builds", "payload"))
    monkeypatch.delenv("VLLM_NEURON_CACHE_SIGNING_KEY")
    monkeypatch.setenv("VLLM_NEURON_CACHE_TRUSTED_KEYS", f"{fleet_key}.pub")
    lines: list[str] = []
    serving = CompileCache(s3_store(s3_bucket, tmp_path / "serving-host"), log=lines.append)
    result = serving.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not result.hit and "refused: record is signed by key" in result.reason
    assert b"payload" not in (result.path / "neuron_config.json").read_bytes()
    assert any("refusing entry" in line and "stays there" in line for line in lines)
    assert s3_store(s3_bucket, tmp_path / "x").get_record(result.key) is not None
    verified = serving.verify()
    assert not verified[0].ok and not verified[0].quarantined

    monkeypatch.setenv("VLLM_NEURON_CACHE_SIGNING_KEY", str(fleet_key))
    compile_host = CompileCache(s3_store(s3_bucket, tmp_path / "compile-host"))
    rebuilt = compile_host.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not rebuilt.hit and "quarantined: record is signed by key" in rebuilt.reason
    assert compile_host.verify()[0].ok


def test_push_publishes_a_build_hosts_entries_under_the_fleet_key(s3_bucket, fleet_key,
                                                                  tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_NEURON_CACHE_SIGNING_KEY")
    build_host = LocalStore(tmp_path / "build-host")
    built = CompileCache(build_host).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    monkeypatch.setenv("VLLM_NEURON_CACHE_SIGNING_KEY", str(fleet_key))
    assert push(build_host, s3_store(s3_bucket, tmp_path / "rc")).copied == [built.key]
    fleet_id = Trust(signing_key=fleet_key, own_key=tmp_path / "none").signer_id
    remote = s3_store(s3_bucket, tmp_path / "rc").get_record(built.key)
    assert remote.signature.key_id == fleet_id

    monkeypatch.delenv("VLLM_NEURON_CACHE_SIGNING_KEY")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "serving-config"))
    monkeypatch.setenv("VLLM_NEURON_CACHE_TRUSTED_KEYS", f"{fleet_key}.pub")
    pulled = pull(s3_store(s3_bucket, tmp_path / "rc2"), LocalStore(tmp_path / "serving"))
    assert pulled.copied == [built.key]
    refused = pull(LocalStore(tmp_path / "build-host"), LocalStore(tmp_path / "other"))
    assert "does not trust" in refused.failed[built.key]
    assert LocalStore(tmp_path / "other").list_keys() == []


def test_keygen_and_trust_verbs(tmp_path, monkeypatch):
    cli = str(Path(sys.executable).with_name("neuron-cache"))
    made = subprocess.run([cli, "keygen", str(tmp_path / "k.pem"), "--json"],
                          capture_output=True, text=True, check=True)
    info = json.loads(made.stdout)
    again = subprocess.run([cli, "keygen", str(tmp_path / "k.pem")], capture_output=True,
                           text=True)
    assert again.returncode == 2 and "never overwrites" in again.stderr
    monkeypatch.setenv("VLLM_NEURON_CACHE_SIGNING_KEY", info["private_key"])
    shown = json.loads(subprocess.run([cli, "trust", "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert shown["signs_with"] == info["key_id"] and shown["publishes_to_shared_stores"]
    assert info["key_id"] in shown["trusted"]


def _share(folder: Path) -> None:
    """Make a store folder writable by its group, as on a shared filesystem."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWGRP)


def test_an_entry_others_can_write_is_loaded_from_a_private_verified_copy(store, tmp_path):
    """Issue 39: in a store another writer can change, a file swapped after the check
    (before the loader opens it) must not be what loads: the loader's folder is a
    private copy made from the bytes that were verified."""
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c", "v1"))
    original = (built.path / "neuron_config.json").read_bytes()
    _share(store.root)
    hit = CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert hit.hit and builds(tmp_path / "c") == ["built"]
    assert store.root not in hit.path.parents
    assert stat.S_IMODE(hit.path.stat().st_mode) == 0o700
    # the other writer swaps the checked file now: the loader's copy is unchanged
    swapped = store.files_path(built.key) / "neuron_config.json"
    swapped.unlink()
    swapped.write_bytes(b'{"forged": true}')
    assert (hit.path / "neuron_config.json").read_bytes() == original
    assert sorted(p.relative_to(hit.path).as_posix() for p in hit.path.rglob("*.neff")) == \
        sorted(p.relative_to(built.path).as_posix() for p in built.path.rglob("*.neff"))


def test_a_private_entry_is_loaded_in_place_and_a_forged_shared_one_never(store, tmp_path):
    """Only this user can change a private store: its entry loads in place. A shared
    entry whose bytes differ from its record is refused, its copy removed."""
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c", "v1"))
    assert cache.get_or_build(manifest_for(), counting_build(tmp_path / "c")).path == built.path
    _share(store.root)
    (store.files_path(built.key) / "neuron_config.json").write_bytes(b"tampered")
    record = store.get_record(built.key)
    copies = verified_copies_dir()
    with pytest.raises(EntryCorrupt, match="neuron_config.json differs from its record"):
        store.materialize(record)
    assert not [p for p in copies.rglob("*") if p.is_dir() and built.key in p.name]
