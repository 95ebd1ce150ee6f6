"""Sizes and durations as people type them on the command line ("50G", "30d")."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_NUMBER = r"(\d+(?:\.\d+)?)"


def parse_size(text: str) -> int:
    """Bytes from '123', '500M', '1.5G', '2T' (binary units; a trailing 'iB'/'B' is
    accepted)."""
    match = re.fullmatch(_NUMBER + r"\s*([KMGT]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if not match:
        raise ValueError(
            f"size {text!r} not understood: use bytes or a number with K, M, G or T, e.g. 50G"
        )
    return int(float(match[1]) * _SIZE_UNITS[match[2].upper()])


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '30m', '12h', '7d', '2w'."""
    match = re.fullmatch(_NUMBER + r"\s*([smhdw]?)", text.strip())
    if not match:
        raise ValueError(
            f"duration {text!r} not understood: use seconds or a number "
            "with s, m, h, d or w, e.g. 30d"
        )
    return float(match[1]) * _TIME_UNITS[match[2]]


def format_size(size: int) -> str:
    """'1.5G'-style, the inverse of parse_size up to rounding."""
    for unit in ("T", "G", "M", "K"):
        if size >= _SIZE_UNITS[unit]:
            return f"{size / _SIZE_UNITS[unit]:.1f}{unit}"
    return f"{size}B"
