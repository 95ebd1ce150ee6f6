"""Every shell command the documentation shows (README.md, CONTRIBUTING.md and docs/)
either parses with the tool it names or names files, scripts, routes and extras that
exist: a renamed flag, a moved script or a dropped extra fails here. Commands that can
run on this machine run elsewhere: the two set-up commands in CI itself, the demo and its
requests in tests/e2e/test_demo.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.docs.shell import Command, commands

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("CONTRIBUTING.md"), *ROOT.glob("docs/**/*.md")])
DOCUMENTED = [command for page in PAGES for command in commands(page, ROOT)]
PARSED = {"vllm", "neuron-plugin", "neuron-buckets", "neuron-cache"}
ENV_NAME = re.compile(r"\b((?:VLLM_NEURON|NEURON)_[A-Z0-9_]+)\b")


def program(command: Command) -> str:
    return Path(command.argv[0]).name


def _python(command: Command) -> str:
    """`python scripts/X.py` is a script to parse; `python -m pip` an install."""
    return "pip" if command.argv[1:3] == ["-m", "pip"] else "script"


def _of(kind: Callable[[Command], bool]) -> list[Command]:
    return [c for c in DOCUMENTED if kind(c)]


def test_the_docs_show_commands_of_every_kind_checked_here():
    kinds = {program(c) for c in DOCUMENTED}
    checked = PARSED | {"python", "python3", "curl", "vllm-router", "docker", "kubectl",
                        "head", "lm_eval"} | {k for k in kinds if k.endswith(".sh")}
    assert sorted(kinds - checked) == [], "add a check for these documented commands"
    assert {"vllm", "neuron-plugin", "curl"} <= kinds


def test_documented_tool_commands_parse_with_the_tools_themselves():
    tools = _of(lambda c: program(c) in PARSED or (
        program(c).startswith("python") and _python(c) == "script"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs" / "parse_commands.py")],
        input=json.dumps([[program(c) if program(c) in PARSED else "python", *c.argv[1:]]
                          for c in tools]),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"})
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    failing = [f"{command}\n    -> {error}" for command, error in zip(tools, errors, strict=True)
               if error is not None]
    assert failing == [], "\n".join(failing)
    assert len(tools) > 20


def test_documented_scripts_exist_and_parse_as_shell():
    for command in _of(lambda c: program(c).endswith(".sh")):
        path = ROOT / command.argv[0]
        assert path.is_file() and os.access(path, os.X_OK), str(command)
        subprocess.run(["bash", "-n", str(path)], check=True)


def test_documented_router_flags_exist():
    routed = _of(lambda c: program(c) == "vllm-router")
    if not routed:
        return
    router = Path(sys.executable).with_name("vllm-router")
    known = subprocess.run([str(router), "--help"], capture_output=True, text=True,
                           timeout=60).stdout
    for command in routed:
        for flag in (w.split("=")[0] for w in command.argv if w.startswith("--")):
            assert re.search(rf"(^|\s){re.escape(flag)}\b", known), (str(command), flag)


def test_documented_lm_eval_commands_parse_with_lm_eval():
    """lm-eval's own parser, its `run` command (what a bare `lm_eval --model ...` runs),
    and its model name registered."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.api.registry import get_model

    commands = _of(lambda c: program(c) == "lm_eval")
    assert commands
    for command in commands:
        args = HarnessCLI()._parser.parse_args(["run", *command.argv[1:]])
        assert get_model(args.model), str(command)


# vLLM's OpenAI-compatible routes the docs send requests to, plus the LoRA ones
ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter",
          "/v1/unload_lora_adapter", "/health", "/metrics"}


def test_documented_requests_have_json_bodies_and_known_routes():
    for command in _of(lambda c: program(c) == "curl"):
        url = next(w for w in command.argv[1:] if "/" in w and not w.startswith("-"))
        assert "/" + url.split("/", 1)[1] in ROUTES, str(command)
        bodies = [command.argv[i + 1] for i, w in enumerate(command.argv) if w == "-d"]
        for body in bodies:
            json.loads(body)


def test_files_the_documented_commands_name_exist():
    named = []
    for command in _of(lambda c: program(c) in ("docker", "kubectl", "head")):
        argv = command.argv
        named += [(command, argv[i + 1]) for i, w in enumerate(argv) if w == "-f"]
        if program(command) == "head":
            named.append((command, argv[-1]))
    for command, path in named:
        assert (ROOT / path).exists(), f"{command}: {path}"
    assert named


def test_documented_installs_name_extras_that_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for command in _of(lambda c: program(c).startswith("python") and _python(c) == "pip"):
        for word in command.argv:
            if match := re.match(r"^\.\[([\w,]+)\]$", word):
                assert set(match[1].split(",")) <= set(extras), str(command)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_environment_variables_the_docs_name_are_read_by_the_code(page):
    code = "\n".join(path.read_text() for folder in ("neuron_plugin", "compile_cache",
                                                     "bucketing", "scripts", "configs",
                                                     "tests")
                     for path in (ROOT / folder).rglob("*") if path.is_file()
                     and path.suffix in (".py", ".sh", ".yaml", ""))
    unknown = sorted({name for name in ENV_NAME.findall(page.read_text())
                      if name not in code})
    assert unknown == [], f"{page.name} names variables nothing reads: {unknown}"
