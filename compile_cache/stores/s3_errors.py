"""Classification of S3 client errors by their error code."""

from __future__ import annotations

from typing import Any

_CONFLICT = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING = {"NoSuchKey", "404"}


def error_code(err: Exception) -> str:
    """The S3 error code of a botocore ClientError ('' for anything else)."""
    response: dict[str, Any] = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def is_conflict(err: Exception) -> bool:
    """A failed If-Match/If-None-Match precondition (412), or S3's 409 for a
    conditional write that raced another write to the same key."""
    return error_code(err) in _CONFLICT


def is_missing(err: Exception) -> bool:
    """The object does not exist."""
    return error_code(err) in _MISSING
