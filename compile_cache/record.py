"""The entry record: the manifest plus a sha256 and size for every artifact file.

A record is written only after every file it lists is in place, so its presence is what
makes an entry visible. Records are parsed defensively: anything malformed or unsafe
raises EntryCorrupt, which makes the cache quarantine the entry instead of loading it.
The digests only bind the files to the record; what binds the record to someone this
host trusts is its Ed25519 signature (`compile_cache.signing`), carried in the record and
checked before anything of the entry is used.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compile_cache.digests import scan_tree, sha256_files
from compile_cache.errors import BuildOutputError, EntryCorrupt, EntryUntrusted, UnsafePathError
from compile_cache.manifest import cache_key
from compile_cache.paths import join_inside, safe_relpath

FORMAT = 1
_SHA_RE = re.compile("[0-9a-f]{64}")
_ID_RE = re.compile("[0-9a-f]{32}")
_KEY_ID_RE = re.compile("[0-9a-f]{16}")
_SIGNATURE_RE = re.compile("[A-Za-z0-9+/]{86}==")  # base64 of 64 bytes


@dataclass(frozen=True)
class FileDigest:
    """What one artifact file must hash to."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Signature:
    """An Ed25519 signature of a record's body by the key with id `key_id`."""

    key_id: str
    value: str  # base64


@dataclass(frozen=True)
class Record:
    """One published entry. `id` is unique per publication, so a quarantine never moves
    aside a newer entry that replaced the one found corrupt."""

    key: str
    id: str
    manifest: dict[str, Any]
    files: Mapping[str, FileDigest]
    created: float
    created_by: str
    build_seconds: float | None = None
    signature: Signature | None = None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())

    def body(self) -> dict[str, Any]:
        """Everything but the signature: what the signature covers."""
        return {
            "format": FORMAT,
            "key": self.key,
            "id": self.id,
            "manifest": self.manifest,
            "files": {
                rel: {"sha256": f.sha256, "size": f.size} for rel, f in sorted(self.files.items())
            },
            "created": self.created,
            "created_by": self.created_by,
            "build_seconds": self.build_seconds,
        }

    def to_json(self) -> bytes:
        data = self.body()
        if self.signature is not None:
            data["signature"] = {"key_id": self.signature.key_id, "ed25519": self.signature.value}
        return json.dumps(data, indent=1, sort_keys=True).encode()


def owner_label() -> str:
    """host:pid, recorded with entries, locks and leases for humans reading them."""
    return f"{socket.gethostname()}:{os.getpid()}"


def new_record(
    manifest: dict[str, Any], files_dir: Path, *, build_seconds: float | None = None
) -> Record:
    """Scan and hash what a build wrote into `files_dir`."""
    try:
        found = scan_tree(files_dir)
    except UnsafePathError as err:
        raise BuildOutputError(
            f"the build output in {files_dir} cannot be cached: {err}; "
            "write regular files (copy the link targets instead)"
        ) from err
    if not found:
        raise BuildOutputError(
            f"the build wrote no files into {files_dir}; build(folder) "
            "must write the compiled artifacts into the folder it is given"
        )
    digests = sha256_files(found)
    return Record(
        key=cache_key(manifest),
        id=uuid.uuid4().hex,
        manifest=manifest,
        files={rel: FileDigest(digests[rel], p.stat().st_size) for rel, p in found.items()},
        created=time.time(),
        created_by=owner_label(),
        build_seconds=build_seconds,
    )


def parse_record(data: bytes, key: str) -> Record:
    """A validated Record from stored bytes; EntryCorrupt names what is wrong."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise EntryCorrupt(key, f"record is not valid JSON ({err})") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise EntryCorrupt(key, f"record format is not {FORMAT}")
    if raw.get("key") != key:
        raise EntryCorrupt(key, f"record names key {raw.get('key')!r}")
    if not isinstance(raw.get("id"), str) or not _ID_RE.fullmatch(raw["id"]):
        raise EntryCorrupt(key, "record has no valid id")
    manifest = raw.get("manifest")
    if not isinstance(manifest, dict) or cache_key(manifest) != key:
        raise EntryCorrupt(key, "record's manifest does not hash to its key")
    files = raw.get("files")
    if not isinstance(files, dict) or not files:
        raise EntryCorrupt(key, "record lists no files")
    parsed: dict[str, FileDigest] = {}
    for rel, info in files.items():
        try:
            safe_relpath(rel)
        except UnsafePathError as err:
            raise EntryCorrupt(key, f"unsafe path: {err}", rel) from err
        sha = info.get("sha256") if isinstance(info, dict) else None
        size = info.get("size") if isinstance(info, dict) else None
        if not (
            isinstance(sha, str) and _SHA_RE.fullmatch(sha) and type(size) is int and size >= 0
        ):
            raise EntryCorrupt(key, f"file {rel} has no valid sha256/size", rel)
        parsed[rel] = FileDigest(sha, size)
    try:
        return Record(
            key=key,
            id=raw["id"],
            manifest=manifest,
            files=parsed,
            created=float(raw["created"]),
            created_by=str(raw["created_by"]),
            build_seconds=raw.get("build_seconds"),
            signature=_parse_signature(key, raw.get("signature")),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise EntryCorrupt(key, f"record field missing or invalid ({err})") from err


def _parse_signature(key: str, raw: Any) -> Signature | None:
    """The record's signature, structurally checked only (`signing` checks it)."""
    if raw is None:
        return None
    key_id = raw.get("key_id") if isinstance(raw, dict) else None
    value = raw.get("ed25519") if isinstance(raw, dict) else None
    if not (
        isinstance(key_id, str)
        and _KEY_ID_RE.fullmatch(key_id)
        and isinstance(value, str)
        and _SIGNATURE_RE.fullmatch(value)
    ):
        raise EntryUntrusted(key, "record has a malformed signature")
    return Signature(key_id, value)


def check_files(root: Path, record: Record) -> None:
    """Raise EntryCorrupt naming the first file under `root` that is missing, extra,
    a link, of the wrong size or with the wrong digest."""
    try:
        found = scan_tree(root)
    except UnsafePathError as err:
        raise EntryCorrupt(record.key, f"unsafe file: {err}", err.path) from err
    except FileNotFoundError as err:
        raise EntryCorrupt(record.key, "artifact folder is missing") from err
    for rel in record.files:
        if rel not in found:
            raise EntryCorrupt(record.key, f"file {rel} is missing", rel)
    for rel in found:
        if rel not in record.files:
            raise EntryCorrupt(record.key, f"file {rel} is not in the record", rel)
    for rel, expected in record.files.items():
        size = join_inside(root, rel).stat().st_size
        if size != expected.size:
            raise EntryCorrupt(
                record.key, f"file {rel} has {size} bytes, expected {expected.size}", rel
            )
    digests = sha256_files({rel: join_inside(root, rel) for rel in record.files})
    for rel, expected in record.files.items():
        if digests[rel] != expected.sha256:
            raise EntryCorrupt(
                record.key,
                f"file {rel} digest mismatch (expected "
                f"{expected.sha256[:12]}..., found {digests[rel][:12]}...)",
                rel,
            )
