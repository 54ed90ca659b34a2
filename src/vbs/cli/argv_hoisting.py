"""Global options anywhere on the line, as the AWS CLI takes them, and where the command of a line is:
what ``main`` reads of argv before Typer does."""

from __future__ import annotations

# Options of the whole CLI (its callback): with a value, and flags.
_GLOBAL_VALUED = ("--endpoint", "--output", "-o", "--ca-bundle", "--query", "--columns", "--profile", "--region")
_GLOBAL_FLAGS = ("--no-paginate",)

# Commands that run a service: their options are their own.
_SERVICES = {"up", "controller", "storage-agent", "host-agent", "csi"}


def command_index(argv: list[str]) -> int:
    """Where the command is: after the options before it (``len(argv)`` when there is none)."""
    pos = 0
    while pos < len(argv) and argv[pos].startswith("-"):
        pos += 2 if argv[pos] in _GLOBAL_VALUED else 1
    return pos


def only_global_options(head: list[str]) -> bool:
    i = 0
    while i < len(head):
        name, sep, _ = head[i].partition("=")
        if name in _GLOBAL_VALUED:
            i += 1 if sep else 2
        elif head[i] in _GLOBAL_FLAGS:
            i += 1
        else:
            return False
    return True


def asks_help(head: list[str]) -> bool:
    """``--help`` is one of the options before the command (not the value of one: ``--query --help``)."""
    i = 0
    while i < len(head):
        if head[i] == "--help":
            return True
        i += 2 if head[i] in _GLOBAL_VALUED else 1
    return False


def hoist_global_options(argv: list[str]) -> list[str]:
    """Global options anywhere on the line, as the AWS CLI takes them: those after the command are
    moved before it (``vbs describe-volumes --output json`` is ``vbs --output json describe-volumes``).
    Nothing after ``--`` moves; a service command's line is left as it is."""
    pos = command_index(argv)
    if pos >= len(argv) or argv[pos] in _SERVICES:
        return argv
    head, command, rest = argv[:pos], argv[pos], argv[pos + 1:]
    moved: list[str] = []
    kept: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            kept += rest[i:]
            break
        name = arg.split("=", 1)[0]
        if name in _GLOBAL_VALUED:
            if "=" in arg:
                moved.append(arg)
                i += 1
            else:
                moved += rest[i:i + 2]
                i += 2
        elif arg in _GLOBAL_FLAGS:
            moved.append(arg)
            i += 1
        else:
            kept.append(arg)
            i += 1
    return [*head, *moved, command, *kept]
