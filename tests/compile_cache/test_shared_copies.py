"""Entries of a store others can write reach the loader as this user's verified copy
(compile_cache/stores/verified_copy.py): made once per entry content and reused by later
starts, linked where only this user can change a file, swept once nobody uses it and its
entry is gone (a SIGKILLed user leaves no copy forever), and the check of who can
change a store covers every folder from `/` down. Real files and processes."""

from __future__ import annotations

import json
import shutil
import signal
import stat
from pathlib import Path

import pytest

from compile_cache.cache import CompileCache
from compile_cache.settings import verified_copies_dir
from compile_cache.stores import LocalStore
from compile_cache.stores.verified_copy import content_name, others_can_change

from .cache_helpers import counting_build, manifest_for, run_worker


def _share(folder: Path, files: bool = True) -> None:
    """Make a store folder writable by its group, as on a shared filesystem (its files
    too unless `files` is false)."""
    for path in [folder, *folder.rglob("*")]:
        if files or path.is_dir():
            path.chmod(path.stat().st_mode | stat.S_IWGRP)


def _built(store: LocalStore, tmp_path: Path, **changes) -> str:
    manifest = manifest_for(**changes)
    CompileCache(store).get_or_build(manifest, counting_build(tmp_path / "c", "v1"))
    path = tmp_path / f"manifest-{len(list(tmp_path.glob('manifest-*')))}.json"
    path.write_text(json.dumps(manifest))
    return str(path)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_a_shared_entry_is_copied_once_and_reused_by_later_starts(tmp_path):
    store = LocalStore(tmp_path / "store")
    manifest = _built(store, tmp_path)
    _share(store.root)
    starts = [run_worker("get_or_build", str(store.root), manifest, str(tmp_path / "n"))
              for _ in range(2)]
    assert all(s["hit"] for s in starts)
    first, second = (Path(s["path"]) for s in starts)
    assert first == second and verified_copies_dir() in first.parents
    assert stat.S_IMODE(first.stat().st_mode) == 0o700
    before = _files(first)
    assert before and _files(CompileCache(store).get_or_build(
        json.loads(Path(manifest).read_text()), counting_build(tmp_path / "c")).path) == before


def test_a_copy_is_swept_once_nobody_uses_it_and_its_entry_is_gone(tmp_path):
    """A server SIGKILLed while using a copy runs no clean-up: its copy stays while its
    entry is in the store (the next start reuses it) and is removed by the next
    materialisation once the entry is gone; never while a live process uses it."""
    store = LocalStore(tmp_path / "store")
    old = _built(store, tmp_path, compiler_flags=["-O1"])
    new = _built(store, tmp_path, compiler_flags=["-O2"])
    _share(store.root)
    users = [run_worker("get_or_build", str(store.root), old, str(tmp_path / "n"),
                        "--then-hang", wait=False) for _ in range(2)]
    try:
        reports = [json.loads(u.stdout.readline()) for u in users]
        copy = Path(reports[0]["path"])
        assert copy == Path(reports[1]["path"]) and copy.is_dir()
        store.remove(reports[0]["key"])  # pruned, evicted or rebuilt elsewhere
        users[0].send_signal(signal.SIGKILL)
        users[0].wait()
        cache = CompileCache(store)
        cache.get_or_build(json.loads(Path(new).read_text()), counting_build(tmp_path / "c"))
        assert copy.is_dir()  # the second user still runs from it
        users[1].send_signal(signal.SIGKILL)
        users[1].wait()
        kept = cache.get_or_build(json.loads(Path(new).read_text()),
                                  counting_build(tmp_path / "c")).path
        assert not copy.exists() and kept.is_dir()
        assert sorted(p.name for p in kept.parent.iterdir()) == sorted(
            [kept.name, f"{kept.name}.lock"])
    finally:
        for user in users:
            user.kill()
            user.wait()


def test_a_partial_copy_of_a_dead_creator_is_cleared(tmp_path):
    store = LocalStore(tmp_path / "store")
    manifest = json.loads(Path(_built(store, tmp_path)).read_text())
    _share(store.root)
    record = store.get_record(store.list_keys()[0])
    first = store.materialize(record)
    partial = first.with_name(f"{content_name(record)}.partial-0123")
    partial.mkdir()
    (partial / "ctx_128.neff").write_bytes(b"half a copy")
    shutil.rmtree(first)  # the copy gone: the next start makes it again
    again = CompileCache(store).get_or_build(manifest, counting_build(tmp_path / "c")).path
    assert again == first and not partial.exists()


def test_files_only_this_user_can_write_are_linked_not_copied(tmp_path):
    """Group-writable folders but files only their owner (this user) may write: the
    copy links them (no second copy of the bytes), and a file the other writer swaps
    in the store afterwards is not what the copy holds."""
    store = LocalStore(tmp_path / "store")
    manifest = json.loads(Path(_built(store, tmp_path)).read_text())
    _share(store.root, files=False)
    hit = CompileCache(store).get_or_build(manifest, counting_build(tmp_path / "c"))
    source = store.files_path(hit.key)
    for rel in _files(hit.path):
        assert (hit.path / rel).stat().st_ino == (source / rel).stat().st_ino
    original = (hit.path / "neuron_config.json").read_bytes()
    swapped = source / "neuron_config.json"
    swapped.unlink()
    swapped.write_bytes(b'{"forged": true}')
    assert (hit.path / "neuron_config.json").read_bytes() == original


@pytest.mark.parametrize("mode, shared", [(0o775, True), (0o1777, False), (0o755, False)],
                         ids=["group-writable", "sticky", "private"])
def test_others_can_change_covers_the_folders_above_the_store(tmp_path, mode, shared):
    """A store whose own folders are private sits in a folder others may write: they can
    rename the whole store away and put a forged one in its place, unless that folder is
    sticky (as /tmp is) and the store this user's."""
    parent = tmp_path / "above"
    parent.mkdir()
    store = LocalStore(parent / "store")
    manifest = json.loads(Path(_built(store, tmp_path)).read_text())
    parent.chmod(mode)
    key = store.list_keys()[0]
    assert others_can_change(store.root, ("entries", key, "files")) is shared
    path = CompileCache(store).get_or_build(manifest, counting_build(tmp_path / "c")).path
    assert (store.root in path.parents) is not shared
