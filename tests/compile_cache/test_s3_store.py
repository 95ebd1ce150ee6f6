"""The cache over S3, against a real S3 API server (moto's server mode) on loopback."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import boto3
import pytest

from compile_cache.cache import CompileCache
from compile_cache.errors import LockTimeout, StoreError
from compile_cache.manifest import cache_key
from compile_cache.stores import LocalStore, S3Store, open_store
from compile_cache.transfer import pull, push

from .cache_helpers import (
    builds,
    counting_build,
    finish,
    manifest_for,
    run_worker,
    write_artifacts,
)


def s3_store(bucket: str, local: Path, ttl: float = 30.0) -> S3Store:
    return S3Store(bucket, "fleet/cache", local=LocalStore(local), lease_ttl=ttl)


def object_names(bucket: str) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_publish_then_lookup_from_another_host_with_an_empty_read_cache(s3_bucket, tmp_path):
    host_a = CompileCache(s3_store(s3_bucket, tmp_path / "host-a"))
    built = host_a.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not built.hit and built.path.is_relative_to(tmp_path / "host-a")
    names = object_names(s3_bucket)
    assert f"fleet/cache/entries/{built.key}.json" in names
    assert sum(n.startswith(f"fleet/cache/objects/{built.key}/") for n in names) == 4
    assert not any(n.startswith("fleet/cache/leases/") for n in names)  # released

    host_b = CompileCache(s3_store(s3_bucket, tmp_path / "host-b"))
    entry = host_b.lookup(manifest_for())
    assert entry is not None and entry.path.is_relative_to(tmp_path / "host-b")
    for rel in entry.record.files:
        assert (entry.path / rel).read_bytes() == (built.path / rel).read_bytes()
    assert host_b.get_or_build(manifest_for(), counting_build(tmp_path / "c")).hit
    assert builds(tmp_path / "c") == ["built"]


def test_open_store_reads_the_url_and_read_cache_from_the_environment(s3_bucket, tmp_path):
    env = {"VLLM_NEURON_CACHE_URL": f"s3://{s3_bucket}/fleet/cache",
           "VLLM_NEURON_CACHE_LOCAL_DIR": str(tmp_path / "read-cache"),
           "VLLM_NEURON_CACHE_LEASE_TTL": "7"}
    store = open_store(environ=env)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.lease_ttl) == (s3_bucket, "fleet/cache", 7.0)
    assert store.local.root == tmp_path / "read-cache"
    CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert CompileCache(s3_store(s3_bucket, tmp_path / "other")).lookup(manifest_for())


def test_two_hosts_contending_for_the_lease_compile_once(s3_bucket, tmp_path):
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest_for()))
    counter = tmp_path / "counter"
    url = f"s3://{s3_bucket}/fleet/cache"
    procs = [run_worker("get_or_build", url, str(manifest_file), str(counter), "--sleep", "1.5",
                        env={"VLLM_NEURON_CACHE_LOCAL_DIR": str(tmp_path / f"host-{i}")},
                        wait=False) for i in range(2)]
    results = [finish(p) for p in procs]
    assert len(builds(counter)) == 1
    assert sorted(r["hit"] for r in results) == [False, True]
    for i, result in enumerate(results):
        assert result["path"].startswith(str(tmp_path / f"host-{i}"))
    assert not any("/leases/" in n for n in object_names(s3_bucket))


def test_a_dead_owners_lease_expires_and_another_host_builds(s3_bucket, tmp_path, caplog):
    key = cache_key(manifest_for())
    url = f"s3://{s3_bucket}/fleet/cache"
    marker = tmp_path / "holding"
    holder = run_worker("hold", url, key, str(marker), wait=False,
                        env={"VLLM_NEURON_CACHE_LEASE_TTL": "1.5",
                             "VLLM_NEURON_CACHE_LOCAL_DIR": str(tmp_path / "dead-host")})
    wait_for(marker)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lease = json.loads(boto3.client("s3").get_object(
        Bucket=s3_bucket, Key=f"fleet/cache/leases/{key}.json")["Body"].read())
    assert lease["pid"] == holder.pid and lease["ttl_seconds"] == 1.5
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="compile_cache"):
        result = CompileCache(s3_store(s3_bucket, tmp_path / "live-host")).get_or_build(
            manifest_for(), counting_build(tmp_path / "c"), wait_timeout=20)
    assert not result.hit and builds(tmp_path / "c") == ["built"]
    assert time.monotonic() - started >= 1.5
    assert f"took over the lease fleet/cache/leases/{key}.json" in caplog.text
    assert f":{holder.pid}:" in caplog.text


def test_a_live_owner_keeps_its_lease_by_renewing_it(s3_bucket, tmp_path):
    key = cache_key(manifest_for())
    url = f"s3://{s3_bucket}/fleet/cache"
    marker = tmp_path / "holding"
    holder = run_worker("hold", url, key, str(marker), wait=False,
                        env={"VLLM_NEURON_CACHE_LEASE_TTL": "1"})
    try:
        wait_for(marker)
        waiter = CompileCache(s3_store(s3_bucket, tmp_path / "waiter", ttl=1))
        with pytest.raises(LockTimeout, match=f"{holder.pid}.*S3 lease"):
            waiter.get_or_build(manifest_for(), counting_build(tmp_path / "c"),
                                wait_timeout=3.5)
    finally:
        holder.kill()
        holder.wait()
    assert builds(tmp_path / "c") == []


def test_a_corrupt_object_in_s3_is_quarantined_and_rebuilt(s3_bucket, tmp_path, caplog):
    built = CompileCache(s3_store(s3_bucket, tmp_path / "host-a")).get_or_build(
        manifest_for(), counting_build(tmp_path / "c", "v1"))
    client = boto3.client("s3")
    name = next(n for n in object_names(s3_bucket) if n.endswith("graphs/ctx_512.neff"))
    client.put_object(Bucket=s3_bucket, Key=name, Body=b"bit rot")
    host_b = CompileCache(s3_store(s3_bucket, tmp_path / "host-b"))
    with caplog.at_level("WARNING", logger="compile_cache"):
        result = host_b.get_or_build(manifest_for(), counting_build(tmp_path / "c", "v2"))
    assert not result.hit and len(builds(tmp_path / "c")) == 2
    assert "file graphs/ctx_512.neff digest mismatch in S3" in result.reason
    assert "graphs/ctx_512.neff" in caplog.text and "quarantine" in caplog.text
    quarantined = [n for n in object_names(s3_bucket) if "/quarantine/" in n]
    assert len(quarantined) == 1
    assert "ctx_512" in json.loads(client.get_object(Bucket=s3_bucket,
                                                     Key=quarantined[0])["Body"].read())["reason"]
    assert b"v2" in (result.path / "graphs" / "ctx_512.neff").read_bytes()
    assert result.key == built.key
    assert CompileCache(s3_store(s3_bucket, tmp_path / "host-c")).verify()[0].ok


@pytest.mark.parametrize("bad_path", ["../../escaped", "/tmp/escaped-absolute"])
def test_an_s3_record_naming_a_path_outside_the_entry_writes_nothing(s3_bucket, tmp_path,
                                                                     bad_path):
    CompileCache(s3_store(s3_bucket, tmp_path / "host-a")).get_or_build(
        manifest_for(), counting_build(tmp_path / "c"))
    client = boto3.client("s3")
    key = cache_key(manifest_for())
    record_name = f"fleet/cache/entries/{key}.json"
    raw = json.loads(client.get_object(Bucket=s3_bucket, Key=record_name)["Body"].read())
    raw["files"][bad_path] = raw["files"]["neuron_config.json"]
    client.put_object(Bucket=s3_bucket, Key=record_name, Body=json.dumps(raw).encode())
    result = CompileCache(s3_store(s3_bucket, tmp_path / "deep" / "host-b")).get_or_build(
        manifest_for(), counting_build(tmp_path / "c"))
    assert not result.hit and "unsafe path" in result.reason
    assert not list(tmp_path.rglob("escaped*")) and not Path("/tmp/escaped-absolute").exists()


def test_an_interrupted_upload_is_invisible_and_swept_by_the_next_builder(s3_bucket, tmp_path):
    key = cache_key(manifest_for())
    client = boto3.client("s3")
    orphan = f"fleet/cache/objects/{key}/{'0' * 32}/graphs/ctx_128.neff"
    client.put_object(Bucket=s3_bucket, Key=orphan, Body=b"half an upload")
    cache = CompileCache(s3_store(s3_bucket, tmp_path / "host"))
    assert cache.lookup(manifest_for()) is None
    cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert orphan not in object_names(s3_bucket)


def test_push_and_pull_between_local_and_s3(s3_bucket, tmp_path):
    build_host = LocalStore(tmp_path / "build-host")
    keys = sorted(CompileCache(build_host).get_or_build(
        manifest_for(neuron_config={"batch_size": b}), counting_build(tmp_path / "c")).key
        for b in (1, 2, 4))
    remote = s3_store(s3_bucket, tmp_path / "push-read-cache")
    report = push(build_host, remote, keys[:2])
    assert (sorted(report.copied), report.skipped, report.failed) == (keys[:2], [], {})
    assert push(build_host, remote).copied == [keys[2]]
    assert sorted(push(build_host, remote).skipped) == keys
    assert remote.list_keys() == keys

    fleet_host = LocalStore(tmp_path / "fleet-host")
    pulled = pull(s3_store(s3_bucket, tmp_path / "pull-read-cache"), fleet_host)
    assert sorted(pulled.copied) == keys
    cache = CompileCache(fleet_host)
    assert all(r.ok for r in cache.verify()) and len(cache.verify()) == 3
    assert cache.lookup(manifest_for(neuron_config={"batch_size": 2})) is not None
    assert CompileCache(s3_store(s3_bucket, tmp_path / "x")).verify() == \
        CompileCache(fleet_host).verify()


def test_pull_does_not_copy_a_corrupt_s3_entry(s3_bucket, tmp_path):
    built = CompileCache(s3_store(s3_bucket, tmp_path / "a")).get_or_build(
        manifest_for(), counting_build(tmp_path / "c"))
    name = next(n for n in object_names(s3_bucket) if n.endswith("neuron_config.json"))
    boto3.client("s3").put_object(Bucket=s3_bucket, Key=name, Body=b"{}")
    report = pull(s3_store(s3_bucket, tmp_path / "b"), LocalStore(tmp_path / "dst"))
    assert report.copied == [] and "neuron_config.json" in report.failed[built.key]
    assert LocalStore(tmp_path / "dst").list_keys() == []


def test_prune_on_s3_removes_records_objects_and_markers(s3_bucket, tmp_path):
    cache = CompileCache(s3_store(s3_bucket, tmp_path / "host"))
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert cache.prune(max_size_bytes=0).removed == [built.key]
    assert object_names(s3_bucket) == []


def test_a_missing_bucket_is_an_error_naming_the_setting(s3_bucket, tmp_path):
    cache = CompileCache(S3Store("no-such-bucket-here", "p", local=LocalStore(tmp_path)))
    with pytest.raises(StoreError, match="does not exist.*VLLM_NEURON_CACHE_URL"):
        cache.lookup(manifest_for())
