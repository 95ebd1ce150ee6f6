"""MkDocs hooks (mkdocs.yml `hooks:`): pages generated from the code at build time, so
the site cannot drift from it. A page holds a marker; the hook replaces it:

- `<!-- reference: override_neuron_config -->`: every accepted key, its value, the NxDI
  releases that read it and what the plugin does with it (core.override_reference);
- `<!-- reference: architecture table -->`: every architecture, the class serving it on
  each backend and NxDI release, and each refusal's reason (neuron_plugin.models);
- `<!-- reference: validate report schema -->`: the JSON schema of `neuron-plugin
  validate`'s report (validation.report);
- `<!-- include: README.md -->`: the README, the site's front page, its links made
  relative to the site (one text for both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _override_reference() -> str:
    from neuron_plugin.core.override_reference import markdown_table

    return markdown_table()


def _architecture_table() -> str:
    from neuron_plugin.models.render import markdown

    return markdown()


def _validate_schema() -> str:
    from neuron_plugin.validation.report import ValidationReport

    schema = json.dumps(ValidationReport.model_json_schema(), indent=2)
    return f"```json\n{schema}\n```"


def _readme() -> str:
    text = (ROOT / "README.md").read_text()
    return text.replace("](docs/", "](").replace("](CONTRIBUTING.md)", "](contributing/testing.md)")


MARKERS = {
    "<!-- reference: override_neuron_config -->": _override_reference,
    "<!-- reference: validate report schema -->": _validate_schema,
    "<!-- reference: architecture table -->": _architecture_table,
    "<!-- include: README.md -->": _readme,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
