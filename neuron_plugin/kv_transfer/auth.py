"""Which KV payloads a decode server trusts: each carries an HMAC-SHA256 tag made with a
key that the servers of one deployment share. No vLLM import.

Whoever can write the payload folder (`/dev/shm` on one host, a shared file system
across hosts) could otherwise plant KV that a decode server loads and keeps in its prefix
cache, where later requests sharing the prompt's first blocks read it. The tag covers the
payload's name (its key), its metadata, its token ids and its KV bytes, so a payload
written without the key, or changed after it was written, is refused and its prompt
computed by the decode server (or the request failed, with kv_load_failure_policy fail).
The trust boundary is the key: a process that can read it can write payloads that load.

The key, found the way the compile cache finds its signing key (compile_cache.signing):
- VLLM_NEURON_KV_KEY: the key itself, at least 32 characters (`openssl rand -hex 32`);
- VLLM_NEURON_KV_KEY_FILE: a file holding it (at least 32 bytes), which only its owner
  may read;
- neither: this user's own key, created on first use at
  $XDG_CONFIG_HOME/vllm-neuron/kv-transfer-key (mode 0600): servers run by one user on
  one host share it with no set-up; servers on several hosts need one of the two above,
  the same on every host.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from compile_cache.settings import user_config_dir
from compile_cache.signing import write_secret_once
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.kv_transfer import KEY_ENV, KEY_FILE_ENV

MIN_KEY_BYTES = 32
TAG_KEY = "hmac"  # the payload metadata entry holding the tag
# Domain separation: a tag over a payload can never be replayed as anything else.
_DOMAIN = b"vllm-neuron kv payload v1\n"


class PayloadKeyError(NeuronConfigError):
    """The payload key is misconfigured; the message names the setting and the fix."""


def own_key_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this user's own payload key lives when none is configured."""
    return user_config_dir(environ) / "vllm-neuron" / "kv-transfer-key"


def _read_key_file(path: Path, source: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise PayloadKeyError(
            f"{source}={str(path)!r} cannot be read ({exc}); point it at a regular file "
            f"holding the deployment's KV payload key (at least {MIN_KEY_BYTES} bytes)."
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PayloadKeyError(f"{source}={str(path)!r} is not a regular file.")
        if info.st_mode & 0o077:
            raise PayloadKeyError(
                f"{source}={str(path)!r} is readable by others (mode "
                f"{oct(info.st_mode & 0o777)}): whoever reads the key can forge KV "
                f"payloads; chmod 600 {path}."
            )
        data = f.read(1 << 16).strip()
    if len(data) < MIN_KEY_BYTES:
        raise PayloadKeyError(
            f"{source}={str(path)!r} holds {len(data)} bytes, fewer than {MIN_KEY_BYTES}; "
            f"write a longer key (e.g. `openssl rand -hex 32 > {path}`)."
        )
    return data


def load_key(environ: Mapping[str, str] = os.environ) -> bytes:
    """The payload key (module docstring), or PayloadKeyError naming the setting."""
    given = environ.get(KEY_ENV, "").strip()
    if given:
        if len(given) < MIN_KEY_BYTES:
            raise PayloadKeyError(
                f"{KEY_ENV} holds {len(given)} characters, fewer than {MIN_KEY_BYTES}; set "
                f"it to the same long random string on every server of the deployment "
                f"(e.g. `openssl rand -hex 32`)."
            )
        return given.encode()
    path = environ.get(KEY_FILE_ENV, "").strip()
    if path:
        return _read_key_file(Path(path).expanduser(), KEY_FILE_ENV)
    own = own_key_path(environ)
    try:
        write_secret_once(own, secrets.token_hex(32).encode())
    except OSError as exc:
        raise PayloadKeyError(
            f"cannot create this user's KV payload key {own} ({exc}); set {KEY_FILE_ENV} "
            f"or {KEY_ENV}, or make {own.parent} writable (it follows XDG_CONFIG_HOME)."
        ) from None
    return _read_key_file(own, "this user's KV payload key")


def tag(
    secret: bytes, key: str, metadata: Mapping[str, str], tensors: Sequence[torch.Tensor]
) -> str:
    """The payload's HMAC-SHA256 (hex) over its key, its metadata (the tag itself aside)
    and the bytes of its tensors, in order."""
    mac = hmac.new(secret, _DOMAIN, hashlib.sha256)
    mac.update(key.encode())
    fields = {k: v for k, v in metadata.items() if k != TAG_KEY}
    mac.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    for tensor in tensors:
        mac.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return mac.hexdigest()


def verify(
    secret: bytes, key: str, metadata: Mapping[str, str], tensors: Sequence[torch.Tensor]
) -> bool:
    """Whether the payload's tag is the one `secret` makes. Compared as bytes: the tag
    is whatever the file holds, and compare_digest raises on a non-ASCII str."""
    given = metadata.get(TAG_KEY, "").encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, tag(secret, key, metadata, tensors).encode())
