"""vbs.cli.params: command-line values read as Typer reads them, Pydantic only where a typed value comes.

Each line goes through a small Typer app twice, once with Typer's own runtime parameters and once
with ``vbs.cli.params``'s, and both must answer the same: the values the command receives, or the
same error and exit code."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import pytest
import typer
import typer.core
from typer.testing import CliRunner

from vbs.cli import params

pytestmark = pytest.mark.unit


class Colour(StrEnum):
    red = "red"
    blue = "blue"


def make_app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def show(
        names: Annotated[list[str] | None, typer.Argument()] = None,
        tag: Annotated[list[str] | None, typer.Option("--tag")] = None,
        text: Annotated[str | None, typer.Option()] = None,
        output: Annotated[str, typer.Option("--output", "-o")] = "auto",
        count: Annotated[int | None, typer.Option()] = None,
        size: Annotated[int, typer.Option(min=1, max=16)] = 1,
        ratio: Annotated[float | None, typer.Option()] = None,
        colour: Annotated[Colour | None, typer.Option()] = None,
        mode: Annotated[Literal["ro", "rw"] | None, typer.Option()] = None,
        where: Annotated[Path | None, typer.Option()] = None,
        upper: Annotated[str | None, typer.Option(parser=str.upper)] = None,
        force: Annotated[bool, typer.Option("--force")] = False,
    ) -> None:
        print(repr((names, tag, text, output, count, size, ratio, colour, mode, where, upper, force)))

    @app.command()
    def other() -> None:
        print("other")

    return app


LINES = [
    ["show"],
    ["show", "a", "b", "--tag", "x=1", "--tag", "y", "--text", "héllo wörld", "-o", "json"],
    ["show", "--text", "", "--count", "12", "--size", "16", "--ratio", "0.5", "--colour", "blue", "--mode", "ro"],
    ["show", "--where", "/tmp/x", "--upper", "abc", "--force"],
    ["show", "--count", "twelve"],
    ["show", "--count", "1.5"],
    ["show", "--size", "0"],
    ["show", "--size", "17"],
    ["show", "--colour", "green"],
    ["show", "--mode", "rx"],
    ["show", "--ratio", "lots"],
]


def run(argv: list[str], builder: object, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    with monkeypatch.context() as m:
        m.setattr(typer.core, "build_runtime_param", builder)
        result = CliRunner().invoke(make_app(), argv)
    return result.exit_code, result.output


@pytest.mark.parametrize("argv", LINES, ids=[" ".join(line) or "none" for line in LINES])
def test_a_line_reads_as_typer_reads_it(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = run(argv, params._typer_runtime_param, monkeypatch)
    ours = run(argv, params.runtime_param, monkeypatch)
    assert ours == theirs
    assert theirs[0] in (0, 2)  # the line was read: a value, or a usage error


def test_text_values_need_no_pydantic_and_a_typed_one_builds_typers_own_once() -> None:
    app = make_app()
    command = typer.main.get_command(app)
    show = command.commands["show"]  # type: ignore[attr-defined]
    by_name = {p.name: p for p in show.params}
    for name in ("names", "tag", "text", "output"):
        assert params._plain(by_name[name].type_descriptor) is not None, name
    for name in ("count", "size", "colour", "mode", "where", "upper"):
        assert params._plain(by_name[name].type_descriptor) is None, name
    light = params.runtime_param(by_name["count"].type_descriptor)
    ctx = typer.Context(show)
    assert light.coerce(None, param=by_name["count"], ctx=ctx) is None
    assert light._built == []  # type: ignore[attr-defined]
    assert light.coerce("7", param=by_name["count"], ctx=ctx) == 7
    assert light.coerce("8", param=by_name["count"], ctx=ctx) == 8
    assert len(light._built) == 1  # type: ignore[attr-defined]
    assert params._text(b"caf\xc3\xa9") == "café"
