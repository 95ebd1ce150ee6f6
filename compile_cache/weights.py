"""A cheap but meaningful fingerprint of a checkpoint's weight files.

Artifacts that embed weights must miss when the weights change. Hashing every byte of
a multi-gigabyte checkpoint on every start would cost tens of seconds, so files larger
than FULL_HASH_LIMIT are fingerprinted by their size, their safetensors header (every
tensor's name, dtype, shape and offsets) and SAMPLES evenly spaced 1 MiB chunks. A
fine-tune changes practically every tensor and therefore the samples; an edit confined
to bytes between samples, with identical sizes and header, would go unnoticed, which is
why `full=True` hashes everything.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
FULL_HASH_LIMIT = 64 << 20
SAMPLES = 16
SAMPLE_BYTES = 1 << 20
_MAX_HEADER = 256 << 20


def weights_fingerprint(folder: str | Path, *, full: bool = False) -> str:
    """Hex sha256 over the name, size and content digest of each weight file directly
    in `folder` (Hugging Face layout; symlinked hub snapshots are followed)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"weights_fingerprint({str(folder)!r}): not a directory; pass the checkpoint folder"
        )
    files = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    if not files:
        raise FileNotFoundError(
            f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in {folder}: "
            "pass the checkpoint folder, or weights_fingerprint=None when the compiled "
            "artifacts do not embed weights"
        )
    total = hashlib.sha256(b"weights-fingerprint-v1\0")
    for path in files:
        size = path.stat().st_size
        mode, digest = _file_digest(path, size, full)
        total.update(f"{path.name}\0{size}\0{mode}\0{digest}\0".encode())
    return total.hexdigest()


def _file_digest(path: Path, size: int, full: bool) -> tuple[str, str]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if full or size <= FULL_HASH_LIMIT:
            while chunk := f.read(SAMPLE_BYTES):
                digest.update(chunk)
            return "full", digest.hexdigest()
        if path.suffix == ".safetensors":
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_len, _MAX_HEADER)))
        for i in range(SAMPLES):  # the first and last samples touch both ends
            f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return "sampled", digest.hexdigest()
