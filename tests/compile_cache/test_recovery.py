"""Stuck and crashing states recover or fail clearly: entry folders without a record, a
full disk, an S3 outage, and waiting for another process's or host's compile."""

from __future__ import annotations

import errno
import io
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from compile_cache.cache import CompileCache
from compile_cache.errors import LockTimeout, StoreFull, StoreUnreachable
from compile_cache.manifest import cache_key
from compile_cache.stores import LocalStore, S3Store

from .cache_helpers import builds, counting_build, manifest_for, run_worker, write_artifacts


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def neuron_cache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("neuron-cache")), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "cache")


# -- entry folders without a record -------------------------------------------------------
def test_an_entry_folder_without_a_record_is_reported_replaced_and_swept(store, tmp_path):
    key = cache_key(manifest_for())
    orphan = store.root / "entries" / key
    (orphan / "files").mkdir(parents=True)
    (orphan / "files" / "stale.neff").write_bytes(b"left behind")

    verified = neuron_cache("verify", "--store", store.url)
    assert verified.returncode == 1
    assert f"{key}  FAILED: entry folder without a record" in verified.stdout
    assert "(quarantined)" in verified.stdout and not orphan.exists()

    (orphan / "files").mkdir(parents=True)
    result = CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not result.hit and (result.path / "neuron_config.json").exists()
    assert not (result.path / "stale.neff").exists()

    other = store.root / "entries" / cache_key(manifest_for(dtype="float32"))
    other.mkdir()
    report = CompileCache(store).prune()
    assert str(other) in report.swept and not other.exists()
    assert store.list_keys() == [key]


# -- a full disk --------------------------------------------------------------------------
def test_a_build_that_fills_the_disk_names_the_store_and_leaves_it_clean(store, tmp_path):
    def build(folder: Path) -> None:
        (folder / "graphs").mkdir()
        (folder / "graphs" / "ctx_128.neff").write_bytes(b"x" * 5000)
        raise OSError(errno.ENOSPC, "No space left on device")  # the next write

    with pytest.raises(StoreFull) as caught:
        CompileCache(store).get_or_build(manifest_for(), build)
    message = str(caught.value)
    assert str(store.root) in message and "had written 5000 bytes" in message
    assert "bytes" in message.split("are free")[0] and "neuron-cache prune" in message
    assert "\n" not in message
    assert store.list_keys() == [] and not any((store.root / "staging").iterdir())
    assert not CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c")).hit


class FullDisk(LocalStore):
    """A read cache whose disk fills up after `room` bytes of artifacts: the injected
    fault. Everything else is the real LocalStore."""

    room = 2000

    def write_artifact(self, staging: Path, rel: str, reader: BinaryIO) -> tuple[str, int]:
        data = reader.read()
        if len(data) > self.room:
            (staging / "files" / "partial").write_bytes(data[:self.room])
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_artifact(staging, rel, io.BytesIO(data))


def test_a_download_that_fills_the_disk_says_how_many_bytes_it_needs(s3_bucket, tmp_path):
    built = CompileCache(S3Store(s3_bucket, "p", local=LocalStore(tmp_path / "a"))).get_or_build(
        manifest_for(), counting_build(tmp_path / "c"))
    size = LocalStore(tmp_path / "a").get_record(built.key).size
    full = FullDisk(tmp_path / "b")
    with pytest.raises(StoreFull) as caught:
        CompileCache(S3Store(s3_bucket, "p", local=full)).lookup(manifest_for())
    message = str(caught.value)
    assert str(full.root) in message and f"it needs {size} bytes" in message
    assert full.list_keys() == [] and not any((full.root / "staging").iterdir())


# -- an S3 outage -------------------------------------------------------------------------
@pytest.fixture
def own_s3(s3_bucket, monkeypatch):
    """A private S3 API server this test may stop, with one bucket."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    boto3.client("s3").create_bucket(Bucket="outage")
    yield server
    server.stop()


def test_an_s3_outage_serves_the_read_cache_or_fails_in_one_line(own_s3, tmp_path):
    read_cache = tmp_path / "read-cache"
    built = CompileCache(S3Store("outage", "p", local=LocalStore(read_cache))).get_or_build(
        manifest_for(), counting_build(tmp_path / "c"))
    own_s3.stop()

    lines: list[str] = []
    cache = CompileCache(S3Store("outage", "p", local=LocalStore(read_cache)), log=lines.append)
    result = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert result.hit and result.path == built.path
    assert "from the read cache" in result.reason and "unreachable" in result.reason
    assert any("S3 is unreachable" in line and "using entry" in line for line in lines)

    with pytest.raises(StoreUnreachable) as caught:
        cache.get_or_build(manifest_for(dtype="float32"), counting_build(tmp_path / "c"))
    message = str(caught.value)
    assert "\n" not in message and "S3 is unreachable" in message
    assert "holds no usable entry" in message and "neuron-cache pull" in message
    assert builds(tmp_path / "c") == ["built"]

    listed = neuron_cache("ls", "--store", "s3://outage/p")
    assert listed.returncode == 2 and len(listed.stderr.strip().splitlines()) == 1


# -- waiting for another compile ----------------------------------------------------------
def test_waiting_for_a_local_compile_shows_who_since_when_and_progress(store, tmp_path,
                                                                       caplog):
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest_for()))
    marker = tmp_path / "halfway"
    holder = run_worker("get_or_build", store.url, str(manifest_file), str(tmp_path / "c"),
                        "--hang", str(marker), wait=False)
    try:
        wait_for(marker)
        with caplog.at_level(logging.INFO, logger="vllm.neuron_plugin.backends.loader"):
            with pytest.raises(LockTimeout) as caught:
                CompileCache(store).get_or_build(
                    manifest_for(), counting_build(tmp_path / "c"), wait_timeout=0.5,
                    log=logging.getLogger("vllm.neuron_plugin.backends.loader"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    waiting = [r for r in caplog.records if r.name == "vllm.neuron_plugin.backends.loader"]
    assert waiting and waiting[0].levelno == logging.INFO
    line = waiting[0].getMessage()
    assert f"being compiled by {socket.gethostname()}:{holder.pid} (since " in line
    assert "1 file (14B) written so far, the last" in line
    assert f"{socket.gethostname()}:{holder.pid}" in str(caught.value)


def test_waiting_for_another_hosts_compile_shows_who_since_when_and_progress(s3_bucket,
                                                                             tmp_path):
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest_for()))
    marker = tmp_path / "halfway"
    url = f"s3://{s3_bucket}/fleet"
    holder = run_worker("get_or_build", url, str(manifest_file), str(tmp_path / "c"),
                        "--hang", str(marker), wait=False,
                        env={"VLLM_NEURON_CACHE_LEASE_TTL": "1.5",
                             "VLLM_NEURON_CACHE_LOCAL_DIR": str(tmp_path / "host-a")})
    try:
        wait_for(marker)
        time.sleep(1.5)  # renewals (every TTL/3) carry the progress
        lines: list[str] = []
        waiter = CompileCache(S3Store(s3_bucket, "fleet", local=LocalStore(tmp_path / "b"),
                                      lease_ttl=1.5), log=lines.append)
        with pytest.raises(LockTimeout):
            waiter.get_or_build(manifest_for(), counting_build(tmp_path / "c"),
                                wait_timeout=0.5)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lines, "the waiter said nothing"
    assert f"{socket.gethostname()}:{holder.pid}:" in lines[0]
    assert "(since " in lines[0] and "1 file (14B) written so far" in lines[0]
