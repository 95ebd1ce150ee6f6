"""The shell commands a Markdown page documents, as argument lists: what
tests/docs/test_commands.py checks against the tools they name."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^( *)```(bash|sh|shell)\n(.*?)^\1```", re.S | re.M)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {">", ">>", "<", "2>", "2>&1"}


@dataclass(frozen=True)
class Command:
    """One documented command: where it is, its environment assignments and argv."""

    page: str
    line: int
    env: dict[str, str]
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def _lines(block: str) -> list[tuple[int, str]]:
    """The block's commands with their first line's offset: continuations joined, a
    newline inside quotes kept, comments dropped."""
    out, current, start, quote = [], [], 0, None
    for number, line in enumerate(block.splitlines()):
        if not current:
            start = number
        for index, char in enumerate(line):
            if quote is None and char == "#" and (index == 0 or line[index - 1].isspace()):
                line = line[:index]  # a comment: the rest of the line
                break
            if quote is None and char in "'\"":
                quote = char
            elif char == quote:
                quote = None
        if quote is not None:  # inside double quotes a backslash-newline joins lines
            joined = quote == '"' and line.endswith("\\")
            current.append(line[:-1] if joined else line + "\n")
            continue
        if line.rstrip().endswith("\\"):
            current.append(line.rstrip()[:-1] + " ")
            continue
        current.append(line)
        text = "".join(current).strip()
        if text:
            out.append((start, text))
        current = []
    return out


def _expand(text: str, variables: dict[str, str]) -> str:
    """`"$NAME"` as one word, bare `$NAME`/`${NAME}` split into words, as a shell does."""
    for name, value in variables.items():
        text = text.replace(f'"${name}"', shlex.quote(value))
        text = re.sub(rf"\$\{{{name}\}}|\${name}\b", lambda _: value, text)
    return text


def commands(path: Path, root: Path) -> list[Command]:
    """Every command in the page's bash blocks (`$PWD` is the repository)."""
    text = path.read_text()
    found = []
    variables = {"PWD": str(root)}  # assignments hold for the rest of the page
    for match in FENCE.finditer(text):
        first_line = text[: match.start(3)].count("\n") + 1
        for offset, line in _lines(match.group(3)):
            words = shlex.split(_expand(line, variables), comments=True)
            for argv in _split(words):
                env = {}
                while argv and ASSIGNMENT.match(argv[0]):
                    name, _, value = argv.pop(0).partition("=")
                    env[name] = value
                if argv[:1] == ["export"]:
                    env |= dict(word.partition("=")[::2] for word in argv[1:])
                    argv = []
                if not argv:
                    variables |= env
                    continue
                found.append(Command(str(path.relative_to(root)), first_line + offset, env,
                                     argv))
    return found


def _split(words: list[str]) -> list[list[str]]:
    """A line's commands (split at && || ; | &), redirections dropped."""
    parts: list[list[str]] = [[]]
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in OPERATORS:
            parts.append([])
        elif word in REDIRECTIONS:
            skip = word != "2>&1"
        else:
            parts[-1].append(word)
    return [p for p in parts if p]
