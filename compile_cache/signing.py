"""Who may publish entries and which entries a host loads: Ed25519-signed records.

A record's digests bind the files to the record, but anyone who can write to the store
can rewrite both. So every record is signed when it is published, and a host loads an
entry only if its record carries a valid signature by a key that host trusts. The keys
never live in a store:

- VLLM_NEURON_CACHE_SIGNING_KEY: the private key this host signs with (PEM PKCS#8,
  unencrypted; `neuron-cache keygen` makes one). Only hosts holding a signing key
  configured this way publish to shared (S3) stores: the fleet's compile hosts.
- VLLM_NEURON_CACHE_TRUSTED_KEYS: comma-separated public-key files (PEM or OpenSSH
  `ssh-ed25519`) whose signatures this host accepts: the serving hosts hold the public
  half of the compile hosts' key.
- Without a configured signing key a user's own key is created on first use at
  $XDG_CONFIG_HOME/vllm-neuron/compile-cache-key.pem (mode 0600, outside every store),
  so a local single-user cache works with no set-up.
- The public half of the key this host signs with is always trusted, and so is the
  user's own key once it exists (only that user can sign with it).
- VLLM_NEURON_CACHE_ON_UNTRUSTED: `rebuild` (default: refuse the entry, log why, and
  compile) or `fail` (refuse to start).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from compile_cache.errors import CacheError, EntryUntrusted
from compile_cache.manifest import canonical_json
from compile_cache.record import Record, Signature
from compile_cache.settings import (
    ON_UNTRUSTED_ENV,
    SIGNING_KEY_ENV,
    TRUSTED_KEYS_ENV,
    user_config_dir,
)

POLICIES = ("rebuild", "fail")
# Domain separation: a signature over a record can never be replayed as anything else.
_DOMAIN = b"vllm-neuron compile-cache record v1\n"


class TrustConfigError(CacheError, ValueError):
    """A signing or trusted key, or the untrusted-entry policy, is misconfigured."""


def own_key_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the user's own signing key lives when none is configured."""
    return user_config_dir(environ) / "vllm-neuron" / "compile-cache-key.pem"


def key_id(public: Ed25519PublicKey) -> str:
    """16 hex digits naming a public key in records, logs and errors."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _payload(record: Record) -> bytes:
    return _DOMAIN + canonical_json(record.body())


def generate_key(path: Path) -> Ed25519PublicKey:
    """Write a new private key to `path` (mode 0600; refuses to overwrite) and its public
    half to `path`.pub; return the public key."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = private.public_key()
    Path(f"{path}.pub").write_bytes(
        public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public


def _load_private(path: Path, source: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise TrustConfigError(
            f"{source}={str(path)!r} is not a readable unencrypted Ed25519 private key in "
            f"PEM ({err}); create one with `neuron-cache keygen PATH`"
        ) from err
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustConfigError(
            f"{source}={str(path)!r} is a {type(key).__name__}, not an "
            "Ed25519 key; create one with `neuron-cache keygen PATH`"
        )
    return key


def _load_public(path: Path) -> Ed25519PublicKey:
    try:
        data = path.read_bytes()
        key: Any = (
            serialization.load_ssh_public_key(data)
            if data.startswith(b"ssh-")
            else serialization.load_pem_public_key(data)
        )
    except (OSError, ValueError, TypeError) as err:
        raise TrustConfigError(
            f"{TRUSTED_KEYS_ENV} names {str(path)!r}, which is not a readable public key "
            f"({err}); list PEM or OpenSSH ssh-ed25519 public-key files separated by "
            "commas, e.g. the .pub file `neuron-cache keygen` wrote"
        ) from err
    if not isinstance(key, Ed25519PublicKey):
        raise TrustConfigError(
            f"{TRUSTED_KEYS_ENV} names {str(path)!r}, a "
            f"{type(key).__name__}; only Ed25519 keys are accepted"
        )
    return key


def write_secret_once(path: Path, data: bytes) -> None:
    """Create the secret file `path` (mode 0600) holding `data` unless it exists. Two
    processes creating it at once agree on one: each writes a temporary file and
    hard-links it into place, and the later link finds the earlier file."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with contextlib.suppress(FileExistsError):  # another process linked first
            os.link(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def _own_key(path: Path) -> Ed25519PrivateKey:
    """The user's own key, created on first use (`write_secret_once`), its public half
    beside it."""
    try:
        write_secret_once(
            path,
            Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        key = _load_private(path, "this user's compile-cache signing key")
        public = Path(f"{path}.pub")
        if not public.exists():
            public.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
    except OSError as err:
        raise TrustConfigError(
            f"cannot create this user's compile-cache signing key {path} ({err}); "
            f"set {SIGNING_KEY_ENV} to a key file (`neuron-cache keygen PATH`) or make "
            f"{path.parent} writable (it follows XDG_CONFIG_HOME)"
        ) from err
    return key


class Trust:
    """The signing key of this host, the keys whose signatures it accepts, and what to
    do with an entry that carries none of them."""

    def __init__(
        self,
        *,
        signing_key: Path | None = None,
        trusted_keys: list[Path] | tuple[Path, ...] = (),
        own_key: Path | None = None,
        on_untrusted: str = "rebuild",
    ):
        if on_untrusted not in POLICIES:
            raise TrustConfigError(
                f"{ON_UNTRUSTED_ENV}={on_untrusted!r} is not a policy; use "
                "'rebuild' (refuse the entry and compile) or 'fail'"
            )
        self.on_untrusted = on_untrusted
        self._explicit = (
            _load_private(signing_key, SIGNING_KEY_ENV) if signing_key is not None else None
        )
        self._own_path = own_key if own_key is not None else own_key_path()
        self._own: Ed25519PrivateKey | None = None
        self._trusted = {key_id(k): k for k in map(_load_public, trusted_keys)}
        if self._explicit is not None:
            self._trusted[key_id(self._explicit.public_key())] = self._explicit.public_key()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Trust:
        """The trust configuration the environment variables describe (module doc)."""
        signing = environ.get(SIGNING_KEY_ENV)
        trusted = [
            Path(p.strip()).expanduser()
            for p in environ.get(TRUSTED_KEYS_ENV, "").split(",")
            if p.strip()
        ]
        return cls(
            signing_key=Path(signing).expanduser() if signing else None,
            trusted_keys=trusted,
            own_key=own_key_path(environ),
            on_untrusted=environ.get(ON_UNTRUSTED_ENV) or "rebuild",
        )

    @property
    def publishes_to_shared_stores(self) -> bool:
        """Whether this host signs with a configured key, which a fleet can trust; a
        user's own key is trusted only by that user, so it never publishes to S3."""
        return self._explicit is not None

    def _signer(self) -> Ed25519PrivateKey:
        if self._explicit is not None:
            return self._explicit
        if self._own is None:
            self._own = _own_key(self._own_path)
            self._trusted[key_id(self._own.public_key())] = self._own.public_key()
        return self._own

    @property
    def signer_id(self) -> str:
        """The key id this host signs with (creating the user's own key if needed)."""
        return key_id(self._signer().public_key())

    def sign(self, record: Record) -> Record:
        """`record` with this host's signature."""
        value = self._signer().sign(_payload(record))
        return dataclasses.replace(
            record, signature=Signature(self.signer_id, base64.b64encode(value).decode("ascii"))
        )

    def trusted_ids(self) -> list[str]:
        """Ids of every key accepted now (the user's own key once it exists)."""
        if self._own is None and self._own_path.exists():
            self._own = _load_private(self._own_path, "this user's compile-cache signing key")
            self._trusted[key_id(self._own.public_key())] = self._own.public_key()
        return sorted(self._trusted)

    def check(self, record: Record) -> None:
        """Raise EntryUntrusted unless `record` is signed by a trusted key."""
        sig = record.signature
        trusted = self.trusted_ids()
        if sig is None:
            raise EntryUntrusted(
                record.key,
                "record is not signed; this host loads only "
                "entries signed by a key it trusts "
                f"({', '.join(trusted) or 'none yet'})",
            )
        public = self._trusted.get(sig.key_id)
        if public is None:
            raise EntryUntrusted(
                record.key,
                f"record is signed by key {sig.key_id}, which this host does not "
                f"trust (trusted: {', '.join(trusted) or 'none'}); if that is your fleet's "
                f"compile host, add its public key to {TRUSTED_KEYS_ENV}",
            )
        try:
            public.verify(base64.b64decode(sig.value), _payload(record))
        except InvalidSignature as err:
            raise EntryUntrusted(
                record.key,
                f"record's signature by key {sig.key_id} does "
                "not match its content: it was altered after signing",
            ) from err

    def describe(self, record: Record) -> str:
        """'signed by K (trusted)' or why not, for listings."""
        try:
            self.check(record)
        except EntryUntrusted as err:
            return f"NOT TRUSTED: {err.problem}"
        return f"signed by {record.signature.key_id} (trusted)"  # type: ignore[union-attr]
