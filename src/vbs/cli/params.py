"""Command-line values read without Pydantic where they are plain text.

Typer (0.29, pinned) turns each value of a command line into its parameter's type through a Pydantic
``TypeAdapter`` that it builds the first time the parameter is processed, even when the value is
absent. The first one imports Pydantic: about a third of a ``vbs describe-volumes`` process, for a
command whose values are strings and one optional integer. ``install()`` replaces Typer's builder
with one that

- reads ``str`` and ``list[str]`` values as Typer's own adapter does (text stays text, bytes are
  decoded), without Pydantic;
- builds Typer's own runtime parameter for any other type only when a value actually comes (``None``
  never reaches it), and then behaves exactly as Typer does: the same checks, the same messages.

tests/test_cli_params.py holds both paths to Typer's own results, and tests/test_cli_startup.py
checks that a describe-volumes line loads no Pydantic.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin

import typer.core
from typer import _coercion
from typer._click import Context, _compat
from typer._coercion import RuntimeParam, TypeDescriptor

__all__ = ["install", "runtime_param"]

_typer_runtime_param = _coercion.build_runtime_param


def _text(value: Any) -> str:
    """A value of a ``str`` parameter, as Typer's adapter makes it (``_adapters._parse_cli_str``)."""
    if value is None:
        raise typer.BadParameter("None is not a valid string")
    if isinstance(value, bytes):
        for encoding in (_compat._get_argv_encoding(), sys.getfilesystemencoding()):
            try:
                return value.decode(encoding)
            except UnicodeError:
                continue
        return value.decode("utf-8", "replace")
    return str(value)


def _plain(descriptor: TypeDescriptor) -> str | None:
    """"text" or "texts" where the parameter is a plain ``str`` or ``list[str]`` without a parser (a
    file parameter never gets here: ``runtime_param`` leaves it to Typer)."""
    if descriptor.parameter_info.parser is not None:
        return None
    annotation: Any = descriptor.annotation
    if annotation is str:
        return "text"
    if get_origin(annotation) is list and get_args(annotation) == (str,):
        return "texts"
    return None


@dataclass(frozen=True)
class _LightParam(RuntimeParam):
    descriptor: TypeDescriptor
    plain: str | None
    _built: list[RuntimeParam] = field(default_factory=list)

    def _coerce_value(self, value: Any, param: typer.core._TyperParameter, ctx: Context) -> Any:
        if self.plain == "text":
            return _text(value)
        if self.plain == "texts":
            return [_text(v) for v in (value if isinstance(value, list | tuple) else [value])]
        if not self._built:
            self._built.append(_typer_runtime_param(self.descriptor))
        return self._built[0]._coerce_value(value, param=param, ctx=ctx)


def runtime_param(descriptor: TypeDescriptor) -> RuntimeParam:
    """What Typer's ``build_runtime_param`` answers, without Pydantic until a non-text value comes."""
    if descriptor.file_annotation is not None:
        return _typer_runtime_param(descriptor)  # Typer opens files itself
    return _LightParam(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation,
                       descriptor=descriptor, plain=_plain(descriptor))


def install() -> None:
    """Make Typer build runtime parameters with ``runtime_param`` (idempotent; nothing where Typer
    has no such builder)."""
    if hasattr(typer.core, "build_runtime_param"):
        typer.core.build_runtime_param = runtime_param
