"""Copying entries between stores, e.g. pushing a build host's cache to S3 or pre-warming
a fleet's local disks from S3. Only entries signed by a key this host trusts are copied.
Into a shared store a host with a configured signing key publishes them under its own
signature, exactly as if it had built them (so a build host's local entries become
fleet entries); otherwise the signature is kept. Every file is verified on the way; the
destination publishes each entry atomically, exactly as after a build."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from compile_cache.disk_space import is_out_of_space, out_of_space
from compile_cache.errors import EntryCorrupt
from compile_cache.manifest import check_key
from compile_cache.settings import local_read_cache_dir
from compile_cache.signing import Trust
from compile_cache.stores import LocalStore, Store


@dataclass
class TransferReport:
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def push(
    src: Store,
    dst: Store,
    keys: list[str] | None = None,
    *,
    progress: bool = False,
    trust: Trust | None = None,
) -> TransferReport:
    """Copy the entries of `src` (all, or `keys`) that `dst` lacks. Entries that fail
    verification in `src`, or are not signed by a key `trust` (default: from the
    environment) accepts, are reported in `failed`, never copied."""
    trust = trust if trust is not None else Trust.from_env()
    report = TransferReport()
    wanted = [check_key(k) for k in keys] if keys is not None else src.list_keys()
    for key in tqdm(wanted, desc=f"{src.url} -> {dst.url}", unit="entry", disable=not progress):
        try:
            if dst.get_record(key) is not None:
                report.skipped.append(key)
                continue
            record = src.get_record(key)
            if record is None:
                report.failed[key] = f"no entry {key} in {src.url}"
                continue
            trust.check(record)
            if dst.shared and trust.publishes_to_shared_stores:
                record = trust.sign(record)
            # `dst` may already hold it now: an S3 source materialises into its read
            # cache, which is the destination when pre-warming this host.
            try:
                dst.import_entry(record, src.materialize(record))
            except OSError as err:
                if is_out_of_space(err):
                    raise out_of_space(
                        dst.disk,
                        f"copying entry {key} from {src.url} to {dst.url}",
                        f"it needs {record.size} bytes",
                    ) from err
                raise
        except EntryCorrupt as err:
            report.failed[key] = str(err)
            continue
        report.copied.append(key)
    return report


def pull(
    src: Store,
    dst: Store | None = None,
    keys: list[str] | None = None,
    *,
    progress: bool = False,
    trust: Trust | None = None,
) -> TransferReport:
    """Copy entries from `src` (typically S3) into `dst`, by default this host's read
    cache of S3 entries ($VLLM_NEURON_CACHE_LOCAL_DIR, else the default local store),
    so later starts load them without downloading."""
    return push(
        src,
        dst if dst is not None else LocalStore(local_read_cache_dir()),
        keys,
        progress=progress,
        trust=trust,
    )
