"""The cache over a local directory: real files, real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from compile_cache.cache import CompileCache, VerifyResult
from compile_cache.errors import BuildOutputError, LockTimeout
from compile_cache.manifest import cache_key
from compile_cache.record import parse_record
from compile_cache.stores import LocalStore

from .cache_helpers import (
    builds,
    counting_build,
    finish,
    manifest_for,
    run_worker,
    write_artifacts,
)


class Lines(list):
    """A `log` callable that keeps every line."""

    def __call__(self, line: str) -> None:
        self.append(line)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "cache")


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_miss_builds_then_hit_returns_the_same_verified_files(store, tmp_path):
    cache = CompileCache(store)
    counter = tmp_path / "counter"
    first = cache.get_or_build(manifest_for(), counting_build(counter))
    assert not first.hit
    assert first.reason == (f"miss: no entry for key {first.key}; the store {store.url} "
                            "has no entries")
    second = cache.get_or_build(manifest_for(), counting_build(counter))
    assert (second.hit, second.reason, second.path) == (True, "hit", first.path)
    assert builds(counter) == ["built"]
    assert sorted(p.relative_to(second.path).as_posix() for p in second.path.rglob("*")
                  if p.is_file()) == ["graphs/ctx_128.neff", "graphs/ctx_256.neff",
                                      "graphs/ctx_512.neff", "neuron_config.json"]
    record = parse_record((store.root / "entries" / first.key / "entry.json").read_bytes(),
                          first.key)
    assert record.manifest == manifest_for() and record.build_seconds is not None


def test_a_changed_bucket_grid_misses_and_the_reason_names_the_field(store, tmp_path):
    cache = CompileCache(store)
    old = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    changed = manifest_for(buckets={"context_encoding_buckets": [128, 2048],
                                    "token_generation_buckets": [128, 256, 512, 1024, 2048]})
    result = cache.get_or_build(changed, counting_build(tmp_path / "c"))
    assert not result.hit
    assert result.reason == (f"miss: no entry for key {result.key}; nearest entry {old.key} "
                             "differs in buckets.context_encoding_buckets")


def test_two_processes_racing_for_one_missing_key_compile_once(store, tmp_path):
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest_for()))
    counter = tmp_path / "counter"
    procs = [run_worker("get_or_build", store.url, str(manifest_file), str(counter),
                        "--sleep", "1.0", wait=False) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert len(builds(counter)) == 1
    assert sorted(r["hit"] for r in results) == [False, True]
    waiter = next(r for r in results if r["hit"])
    assert waiter["reason"].startswith("hit: built by another process while this one waited")
    assert {r["path"] for r in results} == {str(store.root / "entries" / results[0]["key"]
                                                / "files")}
    assert CompileCache(store).lookup(manifest_for()) is not None


def test_a_compile_killed_halfway_leaves_no_entry_and_is_rebuilt(store, tmp_path):
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest_for()))
    counter, marker = tmp_path / "counter", tmp_path / "halfway"
    proc = run_worker("get_or_build", store.url, str(manifest_file), str(counter),
                      "--hang", str(marker), wait=False)
    wait_for(marker)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    leftovers = [p for p in (store.root / "staging").iterdir() if p.is_dir()]
    assert leftovers and (leftovers[0] / "files" / "graphs" / "ctx_128.neff").exists()
    cache = CompileCache(store)
    assert cache.lookup(manifest_for()) is None
    assert cache.list_entries() == []
    log = Lines()
    result = cache.get_or_build(manifest_for(), counting_build(counter), log=log)
    assert not result.hit and len(builds(counter)) == 2
    assert not any(p.is_dir() for p in (store.root / "staging").iterdir())
    assert any("removed leftover of an interrupted build" in line
               and str(leftovers[0]) in line for line in log)


def test_a_flipped_byte_is_detected_quarantined_and_rebuilt(store, tmp_path):
    cache = CompileCache(store)
    counter = tmp_path / "counter"
    first = cache.get_or_build(manifest_for(), counting_build(counter, "v1"))
    victim = first.path / "graphs" / "ctx_256.neff"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    log = Lines()
    result = cache.get_or_build(manifest_for(), counting_build(counter, "v2"), log=log)
    assert not result.hit and len(builds(counter)) == 2
    assert result.reason.startswith(f"miss: entry {first.key} quarantined: file "
                                    "graphs/ctx_256.neff digest mismatch")
    assert any("failed verification: file graphs/ctx_256.neff digest mismatch" in line
               and "quarantine" in line for line in log)
    quarantined = list((store.root / "quarantine").iterdir())
    assert len(quarantined) == 1
    assert "graphs/ctx_256.neff" in (quarantined[0] / "reason.txt").read_text()
    assert b"v2" in (result.path / "graphs" / "ctx_256.neff").read_bytes()
    assert cache.verify() == [VerifyResult(first.key, True)]


def test_lookup_quarantines_a_bad_entry_and_never_returns_it(store, tmp_path, caplog):
    cache = CompileCache(store)
    first = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    (first.path / "neuron_config.json").unlink()
    with caplog.at_level("WARNING", logger="compile_cache"):
        assert cache.lookup(manifest_for()) is None
    assert "file neuron_config.json is missing" in caplog.text
    assert store.list_keys() == []


def test_a_file_added_to_an_entry_is_refused(store, tmp_path):
    cache = CompileCache(store)
    first = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    (first.path / "graphs" / "extra.neff").write_bytes(b"planted")
    assert cache.lookup(manifest_for()) is None
    reason = next((store.root / "quarantine").iterdir()) / "reason.txt"
    assert "graphs/extra.neff is not in the record" in reason.read_text()


@pytest.mark.parametrize("bad_path", ["../x", "graphs/../../x", "/etc/passwd", "./x", "a//b"])
def test_a_record_naming_a_path_outside_the_entry_is_refused(store, tmp_path, bad_path):
    cache = CompileCache(store)
    first = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    record_file = store.root / "entries" / first.key / "entry.json"
    raw = json.loads(record_file.read_text())
    raw["files"][bad_path] = raw["files"].pop("neuron_config.json")
    record_file.write_text(json.dumps(raw))
    log = Lines()
    result = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"), log=log)
    assert not result.hit
    assert f"unsafe path: {bad_path!r}" in result.reason
    assert any(bad_path in line and "quarantine" in line for line in log)
    assert CompileCache(store).lookup(manifest_for()) is not None


def test_a_symlink_leaving_the_entry_is_refused_even_with_matching_content(store, tmp_path):
    cache = CompileCache(store)
    first = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    victim = first.path / "graphs" / "ctx_128.neff"
    outside = tmp_path / "outside.neff"
    outside.write_bytes(victim.read_bytes())  # same digest: only the link is wrong
    victim.unlink()
    victim.symlink_to(outside)
    result = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not result.hit
    assert "graphs/ctx_128.neff' is a symbolic link" in result.reason
    assert outside.read_bytes() == result.path.joinpath("graphs", "ctx_128.neff").read_bytes()


def test_a_symlinked_directory_inside_an_entry_is_refused(store, tmp_path):
    cache = CompileCache(store)
    first = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    graphs = first.path / "graphs"
    graphs.rename(tmp_path / "graphs-outside")
    graphs.symlink_to(tmp_path / "graphs-outside")
    assert cache.lookup(manifest_for()) is None


def test_build_output_with_a_link_is_refused_and_nothing_is_published(store, tmp_path):
    def build(folder: Path) -> None:
        write_artifacts(folder)
        (folder / "weights.safetensors").symlink_to("/etc/hostname")

    with pytest.raises(BuildOutputError, match="weights.safetensors' is a symbolic link"):
        CompileCache(store).get_or_build(manifest_for(), build)
    assert store.list_keys() == []
    assert not any((store.root / "staging").iterdir())


def test_a_failing_build_publishes_nothing_and_releases_the_lock(store, tmp_path):
    def build(folder: Path) -> None:
        write_artifacts(folder)
        raise RuntimeError("neuronx-cc exited with status 70")

    with pytest.raises(RuntimeError, match="status 70"):
        CompileCache(store).get_or_build(manifest_for(), build)
    assert store.list_keys() == []
    result = CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert not result.hit


def test_a_build_that_writes_nothing_is_an_error(store):
    with pytest.raises(BuildOutputError, match="wrote no files"):
        CompileCache(store).get_or_build(manifest_for(), lambda folder: None)


def test_waiting_times_out_with_a_message_naming_the_holder(store, tmp_path):
    key = cache_key(manifest_for())
    marker = tmp_path / "holding"
    holder = run_worker("hold", store.url, key, str(marker), wait=False)
    try:
        wait_for(marker)
        log = Lines()
        with pytest.raises(LockTimeout) as caught:
            CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"),
                                             wait_timeout=0.5, log=log)
    finally:
        holder.kill()
        holder.wait()
    message = str(caught.value)
    assert f"{socket.gethostname()}:{holder.pid}" in message
    assert "wait_timeout" in message and key in message
    assert log and log[0].startswith(f"waiting for compile-cache key {key}")


def test_a_dead_holder_never_blocks(store, tmp_path):
    key = cache_key(manifest_for())
    marker = tmp_path / "holding"
    holder = run_worker("hold", store.url, key, str(marker), wait=False)
    wait_for(marker)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    result = CompileCache(store).get_or_build(manifest_for(), counting_build(tmp_path / "c"),
                                              wait_timeout=5)
    assert not result.hit


def test_prune_removes_old_entries_then_least_recently_used(store, tmp_path):
    cache = CompileCache(store)
    keys = []
    for batch in (1, 2, 4, 8):
        manifest = manifest_for(neuron_config={"tp_degree": 2, "batch_size": batch})
        keys.append(cache.get_or_build(manifest, counting_build(tmp_path / "c")).key)
    now = time.time()
    for age_days, key in zip((40, 3, 1, 2), keys):
        used = now - age_days * 86400
        os.utime(store.root / "entries" / key / "last-used", (used, used))
    size = cache.list_entries()[0].size
    assert [i.key for i in cache.list_entries()] == [keys[0], keys[1], keys[3], keys[2]]
    dry = cache.prune(max_age_seconds=30 * 86400, max_size_bytes=2 * size, dry_run=True)
    assert dry.removed == sorted([keys[0], keys[1]]) and store.list_keys() == sorted(keys)
    report = cache.prune(max_age_seconds=30 * 86400, max_size_bytes=2 * size)
    assert report.removed == sorted([keys[0], keys[1]])
    assert (report.freed_bytes, report.kept_bytes) == (2 * size, 2 * size)
    assert store.list_keys() == sorted([keys[2], keys[3]])


def test_prune_purges_quarantine_and_sweeps_dead_staging(store, tmp_path):
    cache = CompileCache(store)
    first = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    (first.path / "neuron_config.json").write_text("tampered")
    cache.verify()
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest_for(dtype="float32")))
    marker = tmp_path / "halfway"
    proc = run_worker("get_or_build", store.url, str(manifest_file), str(tmp_path / "c"),
                      "--hang", str(marker), wait=False)
    wait_for(marker)
    proc.kill()
    proc.wait()
    report = cache.prune()
    assert len(report.purged_quarantine) == 1 and len(report.swept) == 1
    assert not any((store.root / "quarantine").iterdir())


def test_verify_reports_and_quarantines_only_the_bad_entry(store, tmp_path):
    cache = CompileCache(store)
    good = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    bad = cache.get_or_build(manifest_for(dtype="float32"), counting_build(tmp_path / "c"))
    (bad.path / "graphs" / "ctx_512.neff").write_bytes(b"truncated")
    results = {r.key: r for r in cache.verify()}
    assert results[good.key].ok
    assert not results[bad.key].ok and results[bad.key].quarantined
    assert "graphs/ctx_512.neff has 9 bytes" in results[bad.key].problem
    assert store.list_keys() == [good.key]


def test_explain_reports_hit_or_the_nearest_entries(store, tmp_path):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    hit = cache.explain(manifest_for())
    assert hit["hit"] and hit["entry"]["key"] == built.key
    other = manifest_for(target={"instance": "trn1", "logical_cores": 2}, dtype="float32")
    miss = cache.explain(other)
    assert not miss["hit"]
    assert miss["nearest"] == [{"key": built.key, "differs": ["dtype", "target.instance"]}]


def test_remove_deletes_the_entry_and_a_lookup_misses(store, tmp_path):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    assert cache.remove(built.key) and not cache.remove(built.key)
    assert cache.lookup(manifest_for()) is None


def test_lookup_tracks_last_use(store, tmp_path):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), counting_build(tmp_path / "c"))
    used = store.root / "entries" / built.key / "last-used"
    os.utime(used, (1000.0, 1000.0))
    assert cache.list_entries()[0].last_used == 1000.0
    cache.lookup(manifest_for())
    assert cache.list_entries()[0].last_used > time.time() - 60
