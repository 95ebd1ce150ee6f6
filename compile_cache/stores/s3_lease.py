"""A compile lease in S3: one host compiles a key while the others wait.

Taking the lease is a create-only put (If-None-Match: *) of leases/<key>.json holding the
owner, its host and pid, and the lifetime. The holder renews it every third of its
lifetime with a compare-and-swap put (If-Match: its ETag), so a live lease keeps
changing its ETag. A waiter that sees the same ETag for a whole lifetime, measured on
its own monotonic clock, knows the owner stopped renewing (it died or lost the
network) and takes the lease over with If-Match on that stale ETag; only one waiter can
win that swap. No clocks are compared between hosts, so clock skew cannot expire a live
lease. Release is a conditional delete (If-Match), which never removes a lease that
another host has taken over meanwhile. Each renewal also carries how much the holder's
build has written, so waiters on other hosts can report its progress.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from compile_cache.errors import StoreUnreachable
from compile_cache.locks import progress_text, since_text
from compile_cache.record import owner_label
from compile_cache.safe_fs import tree_size
from compile_cache.stores.s3_errors import is_conflict, is_missing

logger = logging.getLogger("compile_cache")


class S3Lease:
    """The lease of one key in one S3 store (a KeyLock)."""

    def __init__(self, store: Any, key: str, ttl: float):
        self._store = store
        self.object = store.name("leases", f"{key}.json")
        self.ttl = ttl
        self.poll_interval = min(1.0, ttl / 4)
        self.owner = f"{owner_label()}:{uuid.uuid4().hex[:8]}"
        self._acquired = 0.0
        self._renewals = 0
        self._etag: str | None = None
        self._seen: tuple[str, float, dict[str, Any]] | None = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._building: Path | None = None
        self.lost = False

    def _body(self) -> bytes:
        now = time.time()
        body: dict[str, Any] = {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "acquired": self._acquired or now,
            "renewed": now,
            "renewals": self._renewals,
            "ttl_seconds": self.ttl,
        }
        if self._building is not None:
            files, size, _ = tree_size(self._building)
            body["progress"] = {"files": files, "bytes": size}
        return json.dumps(body).encode()

    def building(self, folder: Path) -> None:
        self._building = folder  # reported from the next renewal on

    def _put(self, **condition: str) -> str | None:
        """The new ETag, or None if the condition failed."""
        try:
            response = self._store.call(
                "put_object", Key=self.object, Body=self._body(), **condition
            )
        except Exception as err:
            if is_conflict(err):
                return None
            raise
        return response["ETag"]

    def try_acquire(self) -> bool:
        etag = self._put(IfNoneMatch="*")
        if etag is None:
            etag = self._take_over_if_expired()
        if etag is None:
            return False
        self._etag = etag
        self._acquired = time.time()
        self._stop.clear()
        self._heartbeat = threading.Thread(
            target=self._renew, daemon=True, name=f"lease {self.object}"
        )
        self._heartbeat.start()
        return True

    def _take_over_if_expired(self) -> str | None:
        found = self._store.read_object(self.object)
        if found is None:
            return None  # released just now: the next attempt can create it
        data, etag = found
        now = time.monotonic()
        if self._seen is None or self._seen[0] != etag:
            try:
                body = json.loads(data)
            except ValueError:
                body = {}
            self._seen = (etag, now, body if isinstance(body, dict) else {})
            return None
        _, first_seen, body = self._seen
        ttl = body.get("ttl_seconds")
        ttl = float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else self.ttl
        if now - first_seen < ttl:
            return None
        new = self._put(IfMatch=etag)
        if new is not None:
            logger.warning(
                "compile cache: took over the lease %s of %s, which was not "
                "renewed for %.0f s (its owner died or lost S3)",
                self.object,
                body.get("owner", "an unknown owner"),
                now - first_seen,
            )
        return new

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._mutex:
                if self._stop.is_set() or self._etag is None:  # released
                    return
                self._renewals += 1
                try:
                    etag = self._put(IfMatch=self._etag)
                except Exception as err:  # keep trying: the lease outlives one failure
                    logger.warning("compile cache: renewing lease %s failed: %s", self.object, err)
                    continue
                if etag is None:
                    self.lost = True
                    logger.warning(
                        "compile cache: lease %s was taken over by another host "
                        "while this one still builds; the first to publish wins",
                        self.object,
                    )
                    return
                self._etag = etag

    def holder(self) -> str:
        if self._seen is None:
            return f"another host (lease {self.object})"
        _, first_seen, body = self._seen
        text = f"{body.get('owner', 'an unknown owner')} ("
        if isinstance(body.get("acquired"), (int, float)):
            text += f"{since_text(body['acquired'])} on its clock; "
        progress = body.get("progress")
        if (
            isinstance(progress, dict)
            and isinstance(progress.get("files"), int)
            and isinstance(progress.get("bytes"), int)
        ):
            text += f"{progress_text(progress['files'], progress['bytes'])}; "
        return (
            text + f"S3 lease {self.object}, unchanged for "
            f"{time.monotonic() - first_seen:.0f} s; expires after "
            f"{body.get('ttl_seconds', self.ttl)} s without renewal)"
        )

    def release(self) -> None:
        with self._mutex:
            self._stop.set()
            etag, self._etag = self._etag, None
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if etag is None or self.lost:
            return
        try:
            self._store.call("delete_object", Key=self.object, IfMatch=etag)
        except StoreUnreachable as err:
            logger.warning(
                "compile cache: could not release the lease %s (%s); it expires "
                "after %.0f s without renewal",
                self.object,
                err,
                self.ttl,
            )
        except Exception as err:
            if not (is_conflict(err) or is_missing(err)):
                raise
