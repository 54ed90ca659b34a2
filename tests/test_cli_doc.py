"""docs/cli.md describes every command of ``vbs`` and every option of each: a command or an option
added without a word there fails here (the page is written by hand, checked against ``--help``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup, TyperOption

from vbs.cli.main import app

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
HEADING = re.compile(r"^(#{2,4}) ")


def commands() -> dict[str, Any]:
    """Every command by the words that run it (``db upgrade`` included). Typer carries its own copy of
    click: these are its classes."""
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    found: dict[str, Any] = {}
    for name, command in root.commands.items():
        if isinstance(command, TyperGroup):
            found |= {f"{name} {sub}": c for sub, c in command.commands.items()}
        else:
            found[name] = command
    return found


def flags(command: Any) -> set[str]:
    return {opt for param in command.params if isinstance(param, TyperOption)
            for opt in param.opts if opt.startswith("--") and opt != "--help"}


def section_of(lines: list[str], needle: str) -> str:
    """The text of the section where ``needle`` first appears (from its heading to the next heading),
    with the introduction of the section above it (what a group of commands shares)."""
    # Where the command is introduced: its heading, else the paragraph or item it opens, else where it is named.
    at = next((i for i, line in enumerate(lines) if HEADING.match(line) and needle in line), None)
    if at is None:
        at = next((i for i, line in enumerate(lines) if line.lstrip("- ").startswith(f"`{needle}")), None)
    if at is None:
        at = next(i for i, line in enumerate(lines) if needle in line)
    start = next(i for i in range(at, -1, -1) if HEADING.match(lines[i]))
    end = next((i for i in range(at + 1, len(lines)) if HEADING.match(lines[i])), len(lines))
    level = len(HEADING.match(lines[start]).group(1))  # type: ignore[union-attr]
    parent = next((i for i in range(start - 1, -1, -1) if (m := HEADING.match(lines[i])) and len(m.group(1)) < level),
                  None)
    intro: list[str] = []
    if parent is not None:
        intro = lines[parent:next(i for i in range(parent + 1, len(lines)) if HEADING.match(lines[i]))]
    return "\n".join(intro + lines[start:end])


def test_every_command_and_option_is_on_the_page() -> None:
    lines = DOC.read_text().splitlines()
    text = "\n".join(lines)
    missing: list[str] = []
    for name, command in sorted(commands().items()):
        if f"vbs {name}" not in text:
            missing.append(f"vbs {name}")
            continue
        section = section_of(lines, f"vbs {name}")
        missing += [f"vbs {name} {flag}" for flag in sorted(flags(command)) if flag not in section]
    assert not missing, f"docs/cli.md does not describe: {', '.join(missing)}"


def test_every_global_option_is_on_the_page() -> None:
    lines = DOC.read_text().splitlines()
    section = section_of(lines, "## Global options")
    root = typer.main.get_command(app)
    wanted = flags(root) - {"--help"}
    assert {"--endpoint", "--output", "--query"} <= wanted
    assert not sorted(f for f in wanted if f not in section), section
