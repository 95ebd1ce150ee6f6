"""A store in an S3 bucket under a prefix, shared by a fleet.

Layout under s3://bucket/prefix:
    entries/<key>.json             the record, written last and create-only (If-None-Match)
    objects/<key>/<id>/<path>      the artifacts of one publication (id in the record)
    used/<key>                     empty marker; LastModified is the last hit
    leases/<key>.json              the compile lease (see s3_lease)
    quarantine/<key>/<id>.json     records that failed verification, with the reason
    neuronx-cc/                    neuronx-cc's own per-graph cache
Every publication uploads under its own id, so concurrent or interrupted uploads never
mix files; an upload no record refers to is an orphan that `sweep` deletes. Entries are
downloaded into a LocalStore (the read cache) and verified there before use. Network
and service failures raise StoreUnreachable, so the cache can fall back to the read
cache, and a build finished during an outage is kept there instead of being lost.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compile_cache.digests import hash_stream
from compile_cache.errors import EntryCorrupt, StoreError, StoreUnreachable
from compile_cache.manifest import check_key, is_key
from compile_cache.paths import join_inside
from compile_cache.record import Record, parse_record
from compile_cache.settings import CACHE_URL_ENV, DEFAULT_LEASE_TTL
from compile_cache.stores.base import Store
from compile_cache.stores.local import FILES, LocalStore
from compile_cache.stores.s3_errors import error_code, is_conflict, is_missing
from compile_cache.stores.s3_lease import S3Lease

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client  # the boto3-stubs[s3] types (test extra)

logger = logging.getLogger("compile_cache")

ORPHAN_GRACE = 3600.0
_DENIED = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
}
_OUTAGE = {"InternalError", "ServiceUnavailable", "SlowDown", "500", "502", "503", "504"}


class S3Store(Store):
    """Entries in S3; see the module docstring for the layout."""

    shared = True

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        local: LocalStore,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        orphan_grace: float = ORPHAN_GRACE,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.local = local
        self.lease_ttl = lease_ttl
        self.orphan_grace = orphan_grace
        self._client: S3Client | None = None

    @property
    def disk(self) -> Path:
        return self.local.root

    @property
    def read_cache(self) -> LocalStore:
        return self.local

    # -- plumbing -----------------------------------------------------------------
    def name(self, *parts: str) -> str:
        """The object key of `parts` under the prefix."""
        return "/".join([self.prefix, *parts] if self.prefix else parts)

    def call(self, operation: str, **kwargs: Any) -> Any:
        """One client call on this bucket, with unreachable/denied/missing-bucket
        failures turned into StoreError messages that say what to fix."""
        import boto3
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
            NoCredentialsError,
        )

        if self._client is None:
            self._client = boto3.client("s3")
        try:
            return getattr(self._client, operation)(Bucket=self.bucket, **kwargs)
        except NoCredentialsError as err:
            raise StoreError(
                f"no AWS credentials found for {self.url}: configure the "
                "normal AWS chain (AWS_PROFILE, AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, or an instance role)"
            ) from err
        except ClientError as err:
            code = error_code(err)
            if code == "NoSuchBucket":
                raise StoreError(
                    f"S3 bucket {self.bucket!r} does not exist ({self.url}): "
                    f"create it or fix {CACHE_URL_ENV}"
                ) from err
            if code in _DENIED:
                raise StoreError(
                    f"S3 denied {operation} on {self.url} ({code}): grant "
                    "s3:GetObject, PutObject, DeleteObject and ListBucket on "
                    "the prefix, or check the credentials"
                ) from err
            if code in _OUTAGE:
                raise StoreUnreachable(
                    f"S3 {operation} on {self.url} failed: the service "
                    f"answered {code} after retries"
                ) from err
            raise
        except (ConnectionError, HTTPClientError) as err:
            raise StoreUnreachable(
                f"S3 is unreachable for {self.url} ({operation}: "
                f"{err}); check the network, AWS_REGION and "
                "AWS_ENDPOINT_URL_S3"
            ) from err
        except (BotoCoreError, Boto3Error) as err:
            raise StoreError(
                f"S3 {operation} on {self.url} failed: {err}; check the "
                "network, AWS_REGION and AWS_ENDPOINT_URL_S3"
            ) from err

    def read_object(self, name: str) -> tuple[bytes, str] | None:
        """Body and ETag of an object, None if it does not exist."""
        try:
            response = self.call("get_object", Key=name)
        except Exception as err:
            if is_missing(err):
                return None
            raise
        return response["Body"].read(), response["ETag"]

    def list_objects(self, *parts: str) -> Iterator[dict[str, Any]]:
        """Every object under the folder `parts` (paginated)."""
        kwargs = {"Prefix": self.name(*parts) + "/"}
        while True:
            page = self.call("list_objects_v2", **kwargs)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def _delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):
            batch = [{"Key": n} for n in names[start : start + 1000]]
            self.call("delete_objects", Delete={"Objects": batch, "Quiet": True})

    def _object(self, record: Record, rel: str) -> str:
        return self.name("objects", record.key, record.id, rel)

    # -- reading ----------------------------------------------------------------------
    def list_keys(self) -> list[str]:
        keys = (
            o["Key"].rsplit("/", 1)[-1].removesuffix(".json") for o in self.list_objects("entries")
        )
        return sorted(k for k in keys if is_key(k))

    def get_record(self, key: str) -> Record | None:
        found = self.read_object(self.name("entries", f"{check_key(key)}.json"))
        return None if found is None else parse_record(found[0], key)

    def last_used_times(self) -> dict[str, float]:
        return {
            o["Key"].rsplit("/", 1)[-1]: o["LastModified"].timestamp()
            for o in self.list_objects("used")
        }

    def touch(self, key: str) -> None:
        self.call("put_object", Key=self.name("used", check_key(key)), Body=b"")
        self.local.touch(key)

    def check(self, record: Record) -> None:
        for rel in record.files:
            _verify(record, rel, *hash_stream(self._body(record, rel)))

    def _body(self, record: Record, rel: str) -> Any:
        """The streaming body of one artifact; EntryCorrupt if it is gone."""
        try:
            return self.call("get_object", Key=self._object(record, rel))["Body"]
        except Exception as err:
            if is_missing(err):
                raise EntryCorrupt(record.key, f"file {rel} is missing in S3", rel) from err
            raise

    def materialize(self, record: Record) -> Path:
        """A read-cache folder holding exactly `record`'s files: the local copy if it has
        the same digests and verifies, else a fresh verified download. A local copy of
        other content (an earlier build, a replaced entry) gives way to the S3 record."""
        path = self._local_copy(record)
        if path is not None:
            return path
        with self.local.staging(record.key) as staging:
            self._download(record, staging)
            path, served = self.local.publish(record, staging)
        if served.files != record.files:
            raise StoreError(
                f"the read cache {self.local.url} received another copy of "
                f"entry {record.key} while it was being downloaded; retry"
            )
        return path

    def _local_copy(self, record: Record) -> Path | None:
        local = None
        try:
            local = self.local.get_record(record.key)
            if local is None:
                return None
            if local.files != record.files:
                self.local.remove(record.key)
                return None
            return self.local.materialize(local)
        except EntryCorrupt as err:
            logger.warning(
                "compile cache: local copy of %s in %s failed verification (%s); "
                "downloading it again from %s",
                record.key,
                self.local.url,
                err.problem,
                self.url,
            )
            self.local.quarantine(record.key, local.id if local else None, err.problem)
            return None

    def _download(self, record: Record, staging: Path) -> None:
        for rel in record.files:
            _verify(record, rel, *self.local.write_artifact(staging, rel, self._body(record, rel)))

    # -- writing ----------------------------------------------------------------------
    def staging(self, key: str) -> AbstractContextManager[Path]:
        return self.local.staging(key)

    def publish(self, record: Record, staging: Path) -> tuple[Path, Record]:
        try:
            published = self.import_entry(record, staging / FILES)
        except StoreUnreachable as err:
            logger.warning(
                "compile cache: %s; kept entry %s in the read cache %s only "
                "(`neuron-cache push %s %s` publishes it later)",
                err,
                record.key,
                self.local.url,
                self.local.url,
                self.url,
            )
            return self.local.publish(record, staging)
        if not published:
            winner = self.get_record(record.key)
            if winner is None:
                raise StoreError(
                    f"entry {record.key} vanished from {self.url} while it "
                    "was being published; retry"
                )
            return self.materialize(winner), winner
        return self.local.publish(record, staging)

    def import_entry(self, record: Record, files: Path) -> bool:
        if self.get_record(record.key) is not None:
            return False
        uploaded = []
        for rel in record.files:
            name = self._object(record, rel)
            self.call("upload_file", Filename=str(join_inside(files, rel)), Key=name)
            uploaded.append(name)
        try:
            self.call(
                "put_object",
                Key=self.name("entries", f"{record.key}.json"),
                Body=record.to_json(),
                IfNoneMatch="*",
            )
        except Exception as err:
            if not is_conflict(err):
                raise
            self._delete(uploaded)  # another publisher won; ours is an orphan
            return False
        return True

    def quarantine(self, key: str, record_id: str | None, problem: str) -> bool:
        name = self.name("entries", f"{check_key(key)}.json")
        found = self.read_object(name)
        if found is None:
            return False
        data, etag = found
        try:
            current_id: str | None = parse_record(data, key).id
        except EntryCorrupt:
            current_id = None
        if current_id != record_id:
            return False
        note = {
            "reason": problem,
            "quarantined": time.time(),
            "record": data.decode("utf-8", "replace"),
        }
        self.call(
            "put_object",
            Key=self.name("quarantine", key, f"{record_id or uuid.uuid4().hex}.json"),
            Body=json.dumps(note).encode(),
        )
        try:
            self.call("delete_object", Key=name, IfMatch=etag)
        except Exception as err:
            if is_conflict(err) or is_missing(err):
                return False  # replaced or removed meanwhile: the new entry stays
            raise
        return True

    def remove(self, key: str) -> bool:
        existed = self.read_object(self.name("entries", f"{check_key(key)}.json")) is not None
        self.call("delete_object", Key=self.name("entries", f"{key}.json"))
        self._delete(
            [o["Key"] for o in self.list_objects("objects", key)] + [self.name("used", key)]
        )
        return existed

    def lock(self, key: str) -> S3Lease:
        return S3Lease(self, check_key(key), self.lease_ttl)

    def sweep(self, held_key: str | None = None) -> list[str]:
        """Local staging leftovers, and uploads no record refers to: those of
        `held_key` at once, others once untouched for `orphan_grace` seconds and
        without a lease (a lease holder may be uploading)."""
        swept = self.local.sweep()
        uploads: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for obj in self.list_objects(*(("objects", held_key) if held_key else ("objects",))):
            parts = obj["Key"][len(self.name("objects")) + 1 :].split("/")
            if len(parts) >= 3:
                uploads.setdefault((parts[0], parts[1]), []).append(obj)
        keep = self._referenced_uploads({key for key, _ in uploads})
        leased = {
            o["Key"].rsplit("/", 1)[-1].removesuffix(".json") for o in self.list_objects("leases")
        }
        now = time.time()
        for (key, upload), objects in sorted(uploads.items()):
            newest = max(o["LastModified"].timestamp() for o in objects)
            idle = now - newest >= self.orphan_grace and key not in leased
            if (key, upload) not in keep and (key == held_key or idle):
                self._delete([o["Key"] for o in objects])
                swept.append(f"{self.url}/objects/{key}/{upload}/")
        return swept

    def _referenced_uploads(self, keys: set[str]) -> set[tuple[str, str]]:
        """(key, id) of the current and quarantined records of `keys`."""
        keep = set()
        for key in keys:
            if not is_key(key):
                continue
            try:
                record = self.get_record(key)
            except EntryCorrupt:
                record = None
            if record is not None:
                keep.add((key, record.id))
            keep.update(
                (key, o["Key"].rsplit("/", 1)[-1].removesuffix(".json"))
                for o in self.list_objects("quarantine", key)
            )
        return keep

    def purge_quarantine(self) -> list[str]:
        purged = []
        for obj in self.list_objects("quarantine"):
            key, upload = obj["Key"][len(self.name("quarantine")) + 1 :].split("/", 1)
            upload = upload.removesuffix(".json")
            self._delete(
                [o["Key"] for o in self.list_objects("objects", key, upload)] + [obj["Key"]]
            )
            purged.append(f"{self.url}/quarantine/{key}/{upload}")
        return purged

    def child_url(self, name: str) -> str:
        return f"{self.url}/{name}"


def _verify(record: Record, rel: str, digest: str, size: int) -> None:
    expected = record.files[rel]
    if digest != expected.sha256 or size != expected.size:
        raise EntryCorrupt(
            record.key,
            f"file {rel} digest mismatch in S3 (expected "
            f"{expected.sha256[:12]}..., found {digest[:12]}...)",
            rel,
        )
