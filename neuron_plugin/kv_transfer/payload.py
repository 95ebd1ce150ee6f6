"""The KV payload: one request's KV blocks in a safetensors file a prefill server writes
and a decode server reads once, then deletes. No vLLM import.

    <folder>/<key>.safetensors
      kv         [layers, 2, blocks, block_size, kv_heads, head_dim]  the KV dtype
      token_ids  [num_tokens] int64                                     the prompt
      metadata   format, model, computation, adapter, cache_salt, dtype,  (strings)
               block_size, num_tokens, layout, hmac (kv_transfer.auth)

Safe by construction: safetensors is a JSON header and raw bytes, so reading a payload
runs no code (nothing is unpickled). The key is 32 lowercase hex digits the prefill
server drew at random, so a path is never built from anything else. The file is written
under a temporary name, opened exclusively, and renamed into place, so a reader sees a
whole payload or none. A reader opens it without following a link and without blocking
(a FIFO or a device at its path never stalls the engine) and refuses anything but a
regular file, a file larger than a request's worth of blocks, any tensor or metadata key
it does not know, a payload whose model, computation, adapter, cache salt, dtype, block
size, geometry or prompt is not the loading request's, one whose tag the deployment's
key did not make (`auth`), and KV holding NaN or Inf (which would reach other requests
through the prefix cache), each with the difference and the fix.

What a payload is bound to is what vLLM's prefix cache keys a block by, and more: the
loaded blocks enter the decode server's prefix cache under the decode request's hash,
which covers its LoRA adapter (vLLM 0.32 `kv_cache_utils._gen_lora_extra_hash_keys`:
the adapter's name and path) and its cache salt, so a payload carries the adapter that
computed it (name and the SHA-256 of its verified files, or "base") and the salt's
SHA-256, and a request of another adapter or salt refuses it and computes its prompt
itself: a block computed for one adapter never serves another. `computation` names how
the backend computes KV values (backend, and the NxDI patches that change the math;
`KVGeometry.computation`); `model` covers weights, config and weight quantization.

Deleting a payload never raises: what cannot be deleted is
logged and left to the sweep. Leftovers (a decode server never came) are swept after
`ttl_s`; the folder holds at most `max_bytes` of payloads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from compile_cache.manifest import VOLATILE_MODEL_KEYS
from compile_cache.weights import weights_fingerprint
from neuron_plugin import plugin_logger
from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.kv_transfer import KEY_ENV, KEY_FILE_ENV, default_path
from neuron_plugin.core.quantization import Quantization
from neuron_plugin.kv_transfer import auth
from neuron_plugin.kv_transfer.params import KEY

logger = plugin_logger(__name__)

FORMAT = "neuron-kv/3"
LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"
METADATA_KEYS = frozenset(
    {
        "format",
        "model",
        "computation",
        "adapter",
        "cache_salt",
        "dtype",
        "block_size",
        "num_tokens",
        "layout",
        auth.TAG_KEY,
    }
)
BASE = "base"  # the adapter of a request without one
TENSOR_KEYS = frozenset({"kv", "token_ids"})
SUFFIX = ".safetensors"
_LEFTOVER = re.compile(r"(?:[0-9a-f]{32}\.safetensors|\.[0-9a-f]{32}\.\d+\.partial)")
HEADER_LIMIT = 64 << 10
# safetensors' dtype names
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
SAME_SERVERS = (
    "serve the same checkpoint with the same --dtype, --block-size, "
    "--tensor-parallel-size and weight quantization on the prefill and decode servers"
)


class PayloadError(ValueError):
    """A payload that cannot be used; the message says which and what to do."""


@dataclass(frozen=True)
class RequestScope:
    """What of a request, besides its prompt, decides its KV or who may share it in
    vLLM's prefix cache (module docstring): its LoRA adapter (`adapter_identity`, or
    BASE) and its cache salt (`salt_digest`)."""

    adapter: str = BASE
    cache_salt: str = ""


def adapter_identity(name: str, digest: str) -> str:
    """An adapter as a payload names it: vLLM's name for it and the SHA-256 of the files
    that were checked (`serving.adapter_files.AdapterFiles.digest`)."""
    return f"{name} sha256:{digest}"


def salt_digest(cache_salt: str | None) -> str:
    """A request's cache salt as a payload holds it: its SHA-256 ("" without a salt), so
    the salt itself is never written to the folder."""
    return hashlib.sha256(cache_salt.encode()).hexdigest() if cache_salt else ""


def model_identity(model_dir: str | Path, quantization: Quantization | None = None) -> str:
    """What two servers must share for one's KV to be the other's: the checkpoint's
    weights (compile_cache.weights' fingerprint), its config (names, versions and token
    ids aside) and, when the weights are served quantized (core.quantization), how: the
    quantized checkpoint is derived from these weights, so its dtype, type and the
    modules kept unquantized (not its path, which may differ between hosts)."""

    def stable(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: stable(v) for k, v in value.items() if k not in VOLATILE_MODEL_KEYS}
        if isinstance(value, list):
            return [stable(v) for v in value]
        return value

    config = json.dumps(stable(read_hf_config(model_dir)), sort_keys=True)
    identity = f"{weights_fingerprint(model_dir)}\0{config}"
    if quantization is not None:
        served = [
            quantization.dtype,
            quantization.type,
            sorted(quantization.modules_to_not_convert),
        ]
        identity += "\0" + json.dumps(served)
    return hashlib.sha256(identity.encode()).hexdigest()


def check_key(key: object) -> str:
    """A payload key is 32 lowercase hex digits, so no path is built from anything else."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise PayloadError(
            f"KV payload key {key!r} is not 32 lowercase hex digits: kv_transfer_params "
            f"must carry the key the prefill server returned, unchanged"
        )
    return key


def payload_path(folder: str | Path, key: str) -> Path:
    return Path(folder) / f"{check_key(key)}{SUFFIX}"


def prepare_folder(folder: str | Path) -> Path:
    """The payload folder, created (owner only) if missing: a directory, not a link,
    this user's and writable by no group or other user (payloads hold prompts; another
    user could read them, fill the folder or plant payloads)."""
    path = Path(folder)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    setting = f"kv_connector_extra_config.path={str(folder)!r}"
    if not stat.S_ISDIR(info.st_mode):
        raise PayloadError(
            f"{setting} is not a directory (a symlink or a file); point it at a folder "
            f"both servers share"
        )
    if info.st_uid != os.geteuid():
        raise PayloadError(
            f"{setting} belongs to uid {info.st_uid}, and this server runs as uid "
            f"{os.geteuid()}: a payload folder another user owns lets that user read "
            f"prompts, fill the folder and plant payloads; set "
            f"kv_connector_extra_config.path to a folder of this user's (leaving it out "
            f"gives this user's own default, {default_path()!r}), the same on both servers"
        )
    if info.st_mode & 0o022:
        raise PayloadError(
            f"{setting} has mode {oct(info.st_mode & 0o777)}: its group or other users may "
            f"write it, and so plant or remove payloads; `chmod 700 {path}` (the servers "
            f"create it with mode 0700)"
        )
    return path


def default_max_bytes(folder: str | Path) -> int:
    """The cap on the folder's payloads when none is set: half the space free on its
    file system now (not half its size: /dev/shm is memory others use too)."""
    fs = os.statvfs(folder)
    return fs.f_bavail * fs.f_frsize // 2


def folder_bytes(folder: str | Path) -> int:
    """Bytes of the payloads (and partial writes) in the folder now."""
    used = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if not _LEFTOVER.fullmatch(entry.name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # taken or swept meanwhile
                continue
            if stat.S_ISREG(info.st_mode):
                used += info.st_size
    return used


def write_payload(
    folder: str | Path,
    key: str,
    kv: torch.Tensor,
    token_ids: Sequence[int],
    model: str,
    geometry: KVGeometry,
    secret: bytes,
    max_bytes: int | None = None,
    *,
    scope: RequestScope,
) -> int:
    """Write one request's blocks atomically, tagged with `secret` (auth) and bound to
    its `scope`; the file's size in bytes. Refused when the folder would then hold more
    than `max_bytes`."""
    final = payload_path(folder, key)
    tensors = {
        "kv": kv.contiguous(),
        "token_ids": torch.tensor(list(token_ids), dtype=torch.int64),
    }
    metadata = {
        "format": FORMAT,
        "model": model,
        "computation": geometry.computation,
        "adapter": scope.adapter,
        "cache_salt": scope.cache_salt,
        "dtype": geometry.dtype,
        "block_size": str(geometry.block_size),
        "num_tokens": str(len(token_ids)),
        "layout": LAYOUT,
    }
    metadata[auth.TAG_KEY] = auth.tag(secret, key, metadata, [tensors["token_ids"], tensors["kv"]])
    data = save_safetensors(tensors, metadata=metadata)
    if max_bytes is not None:
        used = folder_bytes(folder)
        if used + len(data) > max_bytes:
            raise PayloadError(
                f"KV payload {key} not written: the folder {folder} holds {used:,} bytes of "
                f"payloads and {len(data):,} more would pass kv_connector_extra_config."
                f"max_bytes={max_bytes:,}; the decode server computes this prompt itself. "
                f"Raise max_bytes, or lower ttl_s if payloads wait there for decode "
                f"servers that never come"
            )
    partial = final.with_name(f".{key}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(partial, final)
    return len(data)


def _refused(key: str, what: str, theirs: Any, ours: Any, fix: str = SAME_SERVERS) -> PayloadError:
    return PayloadError(
        f"KV payload {key} refused: its {what} is {theirs}, this server's is {ours}; {fix}"
    )


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the payload at `path` and its stat: opened without
    following a link and without blocking (a FIFO opens at once, a device never waits
    for data), then refused unless the descriptor is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PayloadError(
            f"no KV payload {path}: the prefill server did not write it (it failed or "
            f"stopped before answering), it expired (ttl_s), or another decode server "
            f"took it; both servers need the same kv_connector_extra_config.path"
        ) from None
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a socket
        raise PayloadError(f"KV payload {path} cannot be opened safely: {exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO, device or socket"
        raise PayloadError(
            f"KV payload {path} is {kind}, not a regular file: only a prefill server's "
            f"payload file is read"
        )
    return fd, info


def _read_whole(path: Path, key: str, limit: int) -> bytes:
    fd, info = _open_regular(path)
    try:
        if info.st_size > limit:
            raise PayloadError(
                f"KV payload {key} refused: {info.st_size} bytes, more than a request's "
                f"worth of this server's KV blocks ({limit} bytes); {SAME_SERVERS}"
            )
        # at most the size checked: a file still growing is refused, never read unbounded
        chunks, left = [], info.st_size + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) != info.st_size:
            raise PayloadError(f"KV payload {key} changed size while it was read")
        return data
    finally:
        os.close(fd)


def _header(data: bytes, key: str, size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor entries, metadata) of a safetensors file of `size` bytes whose first bytes
    are `data`, checked for shape only."""
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if length <= 0 or length > min(HEADER_LIMIT, size - 8, len(data) - 8):
        raise PayloadError(f"KV payload {key} is not a safetensors file (truncated or corrupt)")
    try:
        header = json.loads(data[8 : 8 + length])
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        raise PayloadError(f"KV payload {key} has a corrupt header") from None
    if not isinstance(header, dict):
        raise PayloadError(f"KV payload {key} has a corrupt header")
    metadata = header.pop("__metadata__", None)
    if (
        not isinstance(metadata, dict)
        or set(metadata) != METADATA_KEYS
        or not all(isinstance(value, str) for value in metadata.values())
    ):
        found = sorted(metadata) if isinstance(metadata, dict) else metadata
        raise PayloadError(
            f"KV payload {key} refused: its metadata keys are {found}, expected "
            f"{sorted(METADATA_KEYS)} with string values (format {FORMAT}); install the same "
            f"vllm-neuron-plugin version on the prefill and decode servers"
        )
    if set(header) != TENSOR_KEYS:
        raise PayloadError(
            f"KV payload {key} refused: its tensors are {sorted(header)}, expected "
            f"{sorted(TENSOR_KEYS)}"
        )
    return header, metadata


def _check_format(meta: Mapping[str, str], key: str, num_tokens: int) -> None:
    if meta["format"] != FORMAT or meta["layout"] != LAYOUT:
        raise _refused(
            key,
            "format",
            f"{meta['format']} ({meta['layout']})",
            f"{FORMAT} ({LAYOUT})",
            "install the same vllm-neuron-plugin version on the prefill and decode servers",
        )
    if meta["num_tokens"] != str(num_tokens):
        raise _refused(
            key,
            "prompt length",
            meta["num_tokens"],
            num_tokens,
            "the decode request must carry the prompt the prefill server encoded",
        )


def check_available(folder: str | Path, key: str, num_tokens: int) -> None:
    """PayloadError unless payload `key` is there for a prompt of `num_tokens`: a
    regular file whose header is this format's. Reads the header only (vLLM's API server
    calls it per decode request); `read_payload` checks everything when it loads."""
    path = payload_path(folder, key)
    fd, info = _open_regular(path)
    try:
        data = os.read(fd, 8 + HEADER_LIMIT)
    finally:
        os.close(fd)
    _check_format(_header(data, key, info.st_size)[1], key, num_tokens)


def read_payload(
    folder: str | Path,
    key: str,
    model: str,
    geometry: KVGeometry,
    prompt: Sequence[int],
    max_blocks: int,
    secret: bytes,
    *,
    scope: RequestScope,
) -> torch.Tensor:
    """The blocks of `prompt`'s KV for a request of `scope`, every check passed (module
    docstring)."""
    path = payload_path(folder, key)
    limit = (
        geometry.block_bytes * max_blocks + 8 * (max_blocks * geometry.block_size) + HEADER_LIMIT
    )
    data = _read_whole(path, key, limit)
    header, meta = _header(data, key, len(data))
    _check_format(meta, key, len(prompt))
    if meta["model"] != model:
        raise _refused(key, "model", meta["model"][:16], model[:16])
    if meta["computation"] != geometry.computation:
        raise _refused(key, "KV computation", meta["computation"], geometry.computation)
    _check_scope(meta, key, scope)
    if meta["dtype"] != geometry.dtype:
        raise _refused(key, "KV dtype", meta["dtype"], geometry.dtype)
    if meta["block_size"] != str(geometry.block_size):
        raise _refused(key, "block size", meta["block_size"], geometry.block_size)
    blocks = math.ceil(len(prompt) / geometry.block_size)
    kv_entry, ids_entry = header["kv"], header["token_ids"]
    if not isinstance(kv_entry, dict) or kv_entry.get("dtype") != _ST_DTYPES[geometry.dtype]:
        found = kv_entry.get("dtype") if isinstance(kv_entry, dict) else kv_entry
        raise _refused(key, "kv tensor dtype", found, _ST_DTYPES[geometry.dtype])
    if kv_entry.get("shape") != list(geometry.shape(blocks)):
        raise _refused(
            key, f"kv shape ({LAYOUT})", kv_entry.get("shape"), list(geometry.shape(blocks))
        )
    if (
        not isinstance(ids_entry, dict)
        or ids_entry.get("dtype") != "I64"
        or ids_entry.get("shape") != [len(prompt)]
    ):
        raise PayloadError(f"KV payload {key} refused: token_ids is not int64 [{len(prompt)}]")
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors' own checks: offsets, sizes
        raise PayloadError(f"KV payload {key} is corrupt: {exc}") from None
    kv, token_ids = tensors["kv"], tensors["token_ids"]
    if not auth.verify(secret, key, meta, [token_ids, kv]):
        raise PayloadError(
            f"KV payload {key} refused: its {auth.TAG_KEY} tag is not the one this "
            f"deployment's key makes (written without the key, by a server with another "
            f"key, or changed after it was written); give the prefill and decode servers "
            f"the same {KEY_FILE_ENV} or {KEY_ENV}"
        )
    if token_ids.tolist() != list(prompt):
        raise PayloadError(
            f"KV payload {key} refused: it holds the KV of another prompt of the same "
            f"length; the decode request must carry the prompt the prefill server encoded"
        )
    _check_finite(kv, key)
    return kv


def _check_scope(meta: Mapping[str, str], key: str, scope: RequestScope) -> None:
    """Refuse the KV of another adapter or cache salt than the loading request's: its
    blocks would enter this server's prefix cache under this request's hash."""
    if meta["adapter"] != scope.adapter:
        raise PayloadError(
            f"KV payload {key} refused: it holds the KV of LoRA adapter "
            f"{meta['adapter']!r}, and the loading request's is {scope.adapter!r}; the "
            f"decode request must name the adapter the prefill request ran with (the same "
            f"name and the same adapter files on both servers); its prompt is computed "
            f"here with its own adapter"
        )
    if meta["cache_salt"] != scope.cache_salt:
        raise PayloadError(
            f"KV payload {key} refused: it was computed for a request with another "
            f"cache_salt; the decode request must carry the prefill request's cache_salt "
            f"(its prompt is computed here)"
        )


# NaN and Inf are the floats whose exponent bits are all ones: (integer view, mask).
_EXPONENT = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def all_finite(kv: torch.Tensor) -> bool:
    """Whether `kv` [layers, ...] holds no NaN or Inf: its exponent bits, a layer at a
    time through one buffer (integer work, no float compare; scripts/bench_kv_checks.py
    measures it)."""
    view, mask = _EXPONENT[kv.dtype]
    ints = kv.contiguous().view(view).numpy()
    buffer = np.empty_like(ints[0])
    for layer in ints:
        np.bitwise_and(layer, mask, out=buffer)
        if buffer.max() == mask:
            return False
    return True


def _check_finite(kv: torch.Tensor, key: str) -> None:
    """Refuse KV holding NaN or Inf: loaded blocks enter the prefix cache, and attention
    multiplies even masked values (by zero weights, which NaN survives)."""
    if all_finite(kv):
        return
    bad = ~torch.isfinite(kv)
    layer, half, block = (int(i) for i in bad.nonzero()[0][:3])
    raise PayloadError(
        f"KV payload {key} refused: it holds NaN or Inf ({int(bad.sum())} values; "
        f"the first in layer {layer}'s {'KV'[half]} cache, block {block}); the prefill "
        f"server's KV is corrupt, so the decode server computes the prompt itself"
    )


def remove_payload(folder: str | Path, key: str) -> bool:
    """Delete payload `key` if it is there; False (logged, left to the sweep) when it
    cannot be deleted, e.g. a directory at its path. Never raises: a leftover is not
    worth a server."""
    path = payload_path(folder, key)
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("KV transfer: cannot delete payload %s (%s); remove it by hand", path, exc)
        return False
    return True


def sweep(folder: str | Path, ttl_s: float, now: float | None = None) -> int:
    """Delete payloads (and partial writes) older than `ttl_s`; how many. An entry that
    cannot be deleted is logged and skipped."""
    now = time.time() if now is None else now
    removed = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if not _LEFTOVER.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > ttl_s:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:  # another server swept it first
                continue
            except OSError as exc:
                logger.warning("KV transfer: cannot delete expired payload %s: %s", entry.path, exc)
    return removed
