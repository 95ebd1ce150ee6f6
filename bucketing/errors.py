"""Errors a user can act on: every message names the setting or file, the value, and the fix.

All are ``ValueError`` subclasses so configuration code can catch one type.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class BucketError(ValueError):
    """A bucket grid, bucket file, cost table or trace that cannot be used as given."""


class NoFitError(BucketError):
    """No bucket holds a need; raised per request, so a server can reject it and go on.

    ``need`` and ``largest`` are ints for 1-D grids and tuples (one entry per dimension)
    for N-D grids; ``largest`` is then the per-dimension maximum of the grid.
    """

    def __init__(
        self, need: int | tuple[int, ...], largest: int | tuple[int, ...], what: str = "tokens"
    ):
        self.need = need
        self.largest = largest
        self.what = what
        super().__init__(self._message())

    def _message(self) -> str:
        if isinstance(self.need, tuple) and isinstance(self.largest, tuple):
            short = [
                f"dimension {axis} needs {n} but its largest bucket is {top}"
                for axis, (n, top) in enumerate(zip(self.need, self.largest, strict=True))
                if n > top
            ]
            why = (
                "; ".join(short)
                if short
                else ("no single bucket is >= the need in every dimension")
            )
            return (
                f"no bucket fits {self.need} ({self.what}): {why}; add a bucket >= "
                f"{self.need} in every dimension, or keep requests within {self.largest}"
            )
        return (
            f"no bucket fits {self.need} ({self.what}): the largest bucket is "
            f"{self.largest}; add a bucket >= {self.need} to the grid, or keep requests "
            f"at or below {self.largest}"
        )


class BucketFileError(BucketError):
    """A bucket-set file, cost table or trace with a wrong key or value; names the file."""

    def __init__(self, path: object, key: str | None, problem: str):
        self.path = str(path)
        self.key = key
        where = f"{self.path}: {key}" if key else self.path
        super().__init__(f"{where}: {problem}")


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """A ' (did you mean X?)' hint for a misspelt key, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
