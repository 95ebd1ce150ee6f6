"""Links planted in a store never redirect a write: each test plants one where the cache
creates or writes something and checks that the file or folder it points at is
untouched (same bytes, same mtime, nothing new)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compile_cache.cache import CompileCache
from compile_cache.errors import UnsafePathError
from compile_cache.manifest import cache_key
from compile_cache.stores import LocalStore, S3Store
from compile_cache.transfer import pull

from .cache_helpers import manifest_for, write_artifacts

OLD = 1_000_000_000.0


def build(folder: Path) -> None:
    write_artifacts(folder)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "cache")


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the store that a followed link would overwrite or touch."""
    path = tmp_path / "outside" / "victim.txt"
    path.parent.mkdir()
    path.write_text("precious\n")
    os.utime(path, (OLD, OLD))
    return path


def untouched(victim: Path) -> bool:
    return (victim.read_text() == "precious\n" and victim.stat().st_mtime == OLD
            and sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"])


def test_a_linked_lock_file_is_refused_never_truncated(store, victim):
    locks = store.root / "locks"
    locks.mkdir(parents=True)
    (locks / f"{cache_key(manifest_for())}.lock").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="is a symbolic link.*remove it"):
        CompileCache(store).get_or_build(manifest_for(), build)
    assert untouched(victim)


@pytest.mark.parametrize("folder", ["locks", "staging", "entries"])
def test_a_linked_store_folder_is_refused(store, victim, folder):
    store.root.mkdir(parents=True)
    (store.root / folder).symlink_to(victim.parent)
    with pytest.raises(UnsafePathError, match=f"{folder}' is a symbolic link"):
        CompileCache(store).get_or_build(manifest_for(), build)
    assert untouched(victim)


def test_a_linked_last_used_marker_is_replaced_not_followed(store, victim):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), build)
    marker = built.path.parent / "last-used"
    marker.unlink()
    marker.symlink_to(victim)
    assert cache.get_or_build(manifest_for(), build).hit
    assert untouched(victim)
    assert marker.is_file() and not marker.is_symlink()
    assert cache.list_entries()[0].last_used > OLD


def test_a_linked_quarantine_note_is_replaced_not_followed(store, victim):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), build)
    (built.path.parent / "reason.txt").symlink_to(victim)  # rides along into quarantine
    (built.path / "neuron_config.json").write_text("tampered")
    assert not cache.get_or_build(manifest_for(), build).hit
    assert untouched(victim)
    (quarantined,) = (store.root / "quarantine").iterdir()
    note = quarantined / "reason.txt"
    assert not note.is_symlink() and "neuron_config.json" in note.read_text()


def test_a_linked_quarantine_folder_is_refused(store, victim):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), build)
    (store.root / "quarantine").symlink_to(victim.parent)
    (built.path / "neuron_config.json").write_text("tampered")
    with pytest.raises(UnsafePathError, match="quarantine' is a symbolic link"):
        cache.get_or_build(manifest_for(), build)
    assert untouched(victim)


def test_an_entry_folder_replaced_by_a_link_is_refused_and_removed(store, tmp_path, victim):
    cache = CompileCache(store)
    built = cache.get_or_build(manifest_for(), build)
    entry = built.path.parent
    copy = victim.parent / "entry-copy"
    entry.rename(copy)
    entry.symlink_to(copy)
    result = cache.get_or_build(manifest_for(), build)
    assert not result.hit and "is a symbolic link" in result.reason
    assert not entry.is_symlink() and entry.is_dir()
    assert sorted(p.name for p in copy.iterdir()) == ["entry.json", "files", "last-used"]


def test_pull_into_a_store_with_a_linked_staging_folder_writes_nothing(store, tmp_path,
                                                                       victim):
    CompileCache(store).get_or_build(manifest_for(), build)
    dst = LocalStore(tmp_path / "dst")
    dst.root.mkdir()
    (dst.root / "staging").symlink_to(victim.parent)
    with pytest.raises(UnsafePathError, match="staging' is a symbolic link"):
        pull(store, dst)
    assert untouched(victim) and dst.list_keys() == []


def test_an_s3_download_never_writes_through_a_linked_read_cache_folder(s3_bucket, tmp_path,
                                                                        victim):
    CompileCache(S3Store(s3_bucket, "p", local=LocalStore(tmp_path / "a"))).get_or_build(
        manifest_for(), build)
    read_cache = LocalStore(tmp_path / "b")
    read_cache.root.mkdir()
    (read_cache.root / "staging").symlink_to(victim.parent)
    with pytest.raises(UnsafePathError, match="staging' is a symbolic link"):
        CompileCache(S3Store(s3_bucket, "p", local=read_cache)).lookup(manifest_for())
    assert untouched(victim)


def test_prune_removes_planted_links_without_following_them(store, victim):
    CompileCache(store).get_or_build(manifest_for(), build)
    (store.root / "staging").mkdir(exist_ok=True)
    (store.root / "staging" / "x.lock").symlink_to(victim)
    (store.root / "staging" / "x").symlink_to(victim.parent)
    (store.root / "quarantine").mkdir()
    (store.root / "quarantine" / "q").symlink_to(victim.parent)
    report = CompileCache(store).prune()
    assert report.swept == [str(store.root / "staging" / "x")]
    assert report.purged_quarantine == [str(store.root / "quarantine" / "q")]
    assert untouched(victim)
    assert not any((store.root / "staging").iterdir())
