"""What every benchmark in scripts/ writes: the command, date and machine that produced
the figures, the rows as JSON, and the same rows as a Markdown table."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_meta(script: str, argv: Sequence[str] | None, **extra: Any) -> dict[str, Any]:
    return {
        "command": " ".join(["python", f"scripts/{script}", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores",
        **extra,
    }


def write_results(
    out: Path,
    meta: dict[str, Any],
    data: dict[str, Any],
    header: Sequence[str],
    table: Sequence[Sequence[str]],
) -> str:
    """OUT.json ({"meta": ..., **data}) and OUT.md (the table); returns the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, **data}, indent=2))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    markdown = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    return markdown
