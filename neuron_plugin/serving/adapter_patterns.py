"""The patterns an adapter's `adapter_config.json` holds, matched as PEFT and vLLM match
them, with bounded work.

What the patterns mean:
- `target_modules` (PEFT's `check_target_module_exists`, peft/tuners/tuners_utils.py,
  and `match_target_against_key`, peft/utils/other.py): a string is a regular
  expression full-matched against each module name; a list names modules exactly or by
  their last dotted parts.
- `rank_pattern` and `alpha_pattern` keys (PEFT's `get_pattern_key`, peft/utils/other.py;
  vLLM's `PEFTHelper._match_pattern`, vllm/lora/peft_helper.py, with the `regex`
  module): the first key `k` for which `(.*\\.)?(k)$` matches a module name from its
  start gives that module's rank or alpha.

Adapters are loaded on the engine's thread (vLLM's add_lora), so a pattern from an
adapter's config is data and never runs unbounded there: it is at most PATTERN_CHARS
characters, compiled with `regex` (the module vLLM matches these patterns with), and
every match of one adapter's patterns shares one time budget (`regex`'s timeout, checked
while it backtracks): a pattern that does not compile, or whose matching does not finish
within the budget (catastrophic backtracking), is refused naming the field. A list of
names is matched by set lookups, linear in the modules. `rank_pattern`/`alpha_pattern`
are resolved here once per module and handed to vLLM as the modules' own names
(`literal_patterns`), so vLLM's own matching never meets the adapter's expressions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import regex

PATTERN_CHARS = 4096
# All of one adapter's pattern matching (real patterns take microseconds a module).
BUDGET_S = 1.0


class PatternError(ValueError):
    """A pattern of an adapter's config that cannot be matched; `field` names it."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class Budget:
    """The time left to one adapter's pattern matching."""

    def __init__(self, seconds: float = BUDGET_S):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self, field: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.exceeded(field)
        return left

    def exceeded(self, field: str) -> PatternError:
        return PatternError(
            field,
            f"matching it against the model's module names did not finish within "
            f"{self.seconds:g} s (a pattern that backtracks catastrophically); write it "
            f"as a list of module names, or a regular expression without nested "
            f"repetition",
        )


def _compile(field: str, pattern: object) -> regex.Pattern[str]:
    if not isinstance(pattern, str):
        raise PatternError(field, f"{pattern!r} is not a string")
    if len(pattern) > PATTERN_CHARS:
        raise PatternError(
            field,
            f"a pattern of {len(pattern):,} characters, more than {PATTERN_CHARS:,}; "
            f"list the module names instead",
        )
    try:
        return regex.compile(pattern)
    except (regex.error, RecursionError, OverflowError) as exc:
        raise PatternError(
            field, f"{pattern!r} is not a valid regular expression ({exc})"
        ) from None


def _search(
    field: str, pattern: regex.Pattern[str], name: str, budget: Budget, whole: bool
) -> bool:
    match = pattern.fullmatch if whole else pattern.match
    try:
        return match(name, timeout=budget.left(field)) is not None
    except TimeoutError:
        raise budget.exceeded(field) from None


def _suffixes(name: str) -> list[str]:
    """`name` and each of its last dotted parts (a.b.c: a.b.c, b.c, c)."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def targets_match(targets: object, modules: Iterable[str], budget: Budget) -> bool:
    """Whether PEFT would find any of `targets` among `modules` (module docstring)."""
    field = "target_modules"
    names = list(modules)
    if isinstance(targets, str):
        pattern = _compile(field, targets)
        return any(_search(field, pattern, name, budget, whole=True) for name in names)
    if not isinstance(targets, list | tuple) or not all(isinstance(t, str) for t in targets):
        raise PatternError(field, f"{targets!r} is neither a string nor a list of names")
    wanted = set(targets)
    return any(suffix in wanted for name in names for suffix in _suffixes(name))


def resolve_pattern(
    field: str, pattern: Mapping[str, Any], modules: Iterable[str], budget: Budget
) -> dict[str, Any]:
    """Module name -> the value of the first key of `pattern` that matches it (modules
    no key matches are left out), as vLLM's `PEFTHelper._match_pattern` decides."""
    compiled = []
    for key, value in pattern.items():
        _compile(f"{field} key", key)  # its own errors, before it is embedded
        compiled.append((_compile(f"{field} key", rf"(.*\.)?({key})$"), value))
    resolved = {}
    for name in modules:
        for expression, value in compiled:
            if _search(f"{field} key", expression, name, budget, whole=False):
                resolved[name] = value
                break
    return resolved


def literal_patterns(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """Resolved values keyed so that vLLM's `(.*\\.)?(key)$` matches exactly the module
    each was resolved for (its name, escaped)."""
    return {regex.escape(name): value for name, value in resolved.items()}
