"""Command profiles: the paper's (docs/architecture.md §1) command line extraction, typed.

A profile is a TOML file that tells a driver which commands do its work on one platform::

    [profile]
    kind = "hypervisor"            # whose profile it is: hypervisor, backend, resolver
    description = "libvirt through virsh"
    timeout = 30                   # seconds, for each command unless it says otherwise
    reject = ","                   # characters no value may hold for this platform's tools

    [settings]                     # the operator's constants, usable as placeholders
    uri = "qemu:///system"

    [commands.attach]
    argv = ["virsh", "--connect", "{uri}", "attach-disk", "{vm}", "{path}", "{target}", "--live"]
    timeout = 60
    expect = "{serial}"            # optional: what the output must hold for success
    lines = '^\\s*(?P<vm>\\S+)\\s*$' # optional: how to read one line of the output

Every command is an argv list, never a shell line. What a driver may ask of a kind of profile is
its ``ProfileSchema``: the commands (required or optional) and the placeholders each may use. A
profile is checked in full when it is loaded — an unknown key, command or placeholder, a wrong type,
a setting that could not be rendered safely — and a profile that fails stops the agent at start with
a message naming the file, the line and the offending key or placeholder. Values are checked again
each time a command is rendered (``placeholders``), before anything runs.
"""

from __future__ import annotations

import re
import string
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from vbs.errors import DriverError, InvalidParameter
from vbs.profiles.placeholders import LIBRARY, Placeholder, check_floor
from vbs.system import argv
from vbs.system.processes import minimal_environment

__all__ = [
    "ArgGroup",
    "CommandSchema",
    "ProfileSchema",
    "CommandSpec",
    "Profile",
    "ProfileError",
    "CommandFailed",
    "CommandOutput",
    "load_profile",
    "shipped_profiles",
    "DEFAULT_PROFILE_DIR",
    "PROFILE_NAME_RE",
]

DEFAULT_PROFILE_DIR = Path("/etc/vbs/profiles")
PROFILE_NAME_RE = r"[a-z0-9][a-z0-9_-]{0,31}"
_FIELD_RE = r"[a-z][a-z0-9_]{0,31}"
_SETTING_RE = r"[A-Za-z0-9_.:/@+=,%-]{1,255}"
_MAX_TIMEOUT = 3600.0
_MAX_ARGS = 64
_OUTPUT_KEPT = 2000


class ProfileError(InvalidParameter):
    """A profile that cannot be used; the message names the file, the line and what is wrong."""


class CommandFailed(DriverError):
    """A profile's command failed (exit status, timeout or missing ``expect``); the message carries
    the tail of what it printed, which the controller keeps in the operation's step."""


@dataclass(frozen=True)
class CommandSchema:
    """What a driver allows in one command of its profiles: the placeholders it supplies (beyond the
    profile's settings) and whether every profile must have the command."""

    placeholders: frozenset[str]
    required: bool = True
    description: str = ""


@dataclass(frozen=True)
class ProfileSchema:
    """What a kind of profile may hold. ``options``: keys of ``[profile]`` beyond the common ones,
    each with the pattern its value must match in full and its default. ``typed_by_profile``:
    placeholders whose pattern each profile gives itself (``[placeholders]``), such as a cloud's
    instance id."""

    kind: str
    commands: Mapping[str, CommandSchema]
    options: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    typed_by_profile: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ArgGroup:
    """Arguments given only when VBS has a value for ``when`` (``{ when = "nbd_socket", args = [...] }``
    in an argv: a unix socket's flags, or a host and port's, in one profile)."""

    when: str
    args: tuple[str, ...]


Arg = str | ArgGroup


def _flat(args: Sequence[Arg]) -> list[str]:
    return [t for a in args for t in ((a,) if isinstance(a, str) else a.args)]


@dataclass(frozen=True)
class CommandSpec:
    name: str
    argv: tuple[Arg, ...]
    timeout: float
    expect: str | None = None
    lines: re.Pattern[str] | None = None
    # A second argv run once the first succeeded (a monitor that takes one command per call).
    then: tuple[Arg, ...] | None = None

    @property
    def fields(self) -> frozenset[str]:
        """The placeholders and settings its templates name."""
        groups = [a.when for a in (*self.argv, *(self.then or ())) if isinstance(a, ArgGroup)]
        return frozenset(_fields_of([*_flat(self.argv), *_flat(self.then or ()),
                                     *((self.expect,) if self.expect else ())]) + groups)


@dataclass(frozen=True)
class CommandOutput:
    stdout: str
    stderr: str

    def matches(self, spec: CommandSpec) -> list[dict[str, str]]:
        """The named groups of every output line that ``spec.lines`` matches (lines that do not are
        headers and other noise)."""
        if spec.lines is None:
            return []
        found = []
        for line in self.stdout.splitlines():
            m = spec.lines.fullmatch(line)
            if m:
                found.append({k: v for k, v in m.groupdict().items() if v is not None})
        return found


@dataclass(frozen=True)
class Profile:
    """A loaded, checked profile."""

    name: str
    kind: str
    path: Path
    description: str
    options: Mapping[str, str]
    settings: Mapping[str, str]
    commands: Mapping[str, CommandSpec]
    placeholders: Mapping[str, Placeholder]
    reject: str = ""

    def has(self, command: str) -> bool:
        return command in self.commands

    def render(self, command: str, values: Mapping[str, object]) -> list[list[str]]:
        """The argv lists of ``command`` (its ``argv``, and ``then`` if it has one) with ``values``
        (and the settings) put in. Every value is checked first, in every argv: one that fails
        raises ``InvalidParameter`` and nothing runs."""
        spec = self._spec(command)
        return [self._render_args(args, values) for args in (spec.argv, spec.then) if args]

    def _render_args(self, args: Sequence[Arg], values: Mapping[str, object]) -> list[str]:
        out: list[str] = []
        for arg in args:
            if isinstance(arg, str):
                out.append(self._render_one(arg, values))
            elif values.get(arg.when) is not None:
                out.extend(self._render_one(a, values) for a in arg.args)
        return out

    def fill(self, template: str, values: Mapping[str, object]) -> str:
        """One template (a path pattern of the profile's options) with checked ``values`` put in."""
        try:
            _fields_of([template])
        except ValueError as exc:
            raise ProfileError(f"profile {self.path}: {exc} is not a placeholder") from exc
        return self._render_one(template, values)

    def run(self, command: str, values: Mapping[str, object], *, env: Mapping[str, str] | None = None) -> CommandOutput:
        """Run ``command``: a non-zero exit, a timeout, or an ``expect`` missing from the output
        raises ``CommandFailed`` with the tail of the output."""
        out, expect, what = self._execute(command, values, env)
        if expect is not None and expect not in out.stdout:
            raise CommandFailed(f"{what} succeeded but its output does not show {expect!r}: "
                                f"{_tail(out.stdout, out.stderr)}")
        return out

    def probe(self, command: str, values: Mapping[str, object]) -> bool:
        """Ask a yes-or-no question: exit status 0 with ``expect`` in the output (or no ``expect``)
        is yes, exit status 0 without it is no; a failure to answer raises ``CommandFailed`` (never
        taken for a no)."""
        out, expect, _what = self._execute(command, values, None)
        return expect is None or expect in out.stdout

    def _execute(self, command: str, values: Mapping[str, object],
                 env: Mapping[str, str] | None) -> tuple[CommandOutput, str | None, str]:
        spec = self._spec(command)
        argvs = self.render(command, values)
        expect = self._render_one(spec.expect, values) if spec.expect else None
        what = f"profile {self.name}: {command} ({argvs[0][0]})"
        stdout, stderr = [], []
        for args in argvs:
            try:
                proc = argv.run(args, timeout=spec.timeout, check=False, env=minimal_environment(**(env or {})))
            except DriverError as exc:
                raise CommandFailed(f"{what}: {exc.message}") from exc
            stdout.append(proc.stdout)
            stderr.append(proc.stderr)
            if proc.returncode != 0:
                raise CommandFailed(f"{what} exited with {proc.returncode}: {_tail(proc.stdout, proc.stderr)}")
        return CommandOutput("".join(stdout), "".join(stderr)), expect, what

    def _spec(self, command: str) -> CommandSpec:
        spec = self.commands.get(command)
        if spec is None:
            raise InvalidParameter(f"profile {self.name} has no {command!r} command")
        return spec

    def _render_one(self, template: str, values: Mapping[str, object]) -> str:
        out: list[str] = []
        for literal, name, _spec, _conv in string.Formatter().parse(template):
            out.append(literal)
            if name is None:
                continue
            if name in self.settings:
                out.append(self.settings[name])
            elif name in values:
                out.append(self.placeholders[name].render(values[name], self.reject))
            else:
                raise InvalidParameter(f"profile {self.name}: no value for {{{name}}}")
        return "".join(out)


def _tail(stdout: str, stderr: str) -> str:
    text = "\n".join(part.strip() for part in (stderr, stdout) if part.strip())
    return text[-_OUTPUT_KEPT:] or "(no output)"


def _fields_of(templates: Sequence[str]) -> list[str]:
    names = []
    for template in templates:
        for _literal, name, spec, conv in string.Formatter().parse(template):
            if name is None:
                continue
            if spec or conv or not re.fullmatch(_FIELD_RE, name):
                raise ValueError(f"{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}")
            names.append(name)
    return names


def shipped_profiles(kind: str) -> list[str]:
    """The names of the profiles VBS ships for ``kind``."""
    folder = resources.files("vbs.profiles").joinpath(kind)
    if not folder.is_dir():
        return []
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def _find(kind: str, ref: str, dirs: Sequence[Path]) -> Path:
    if "/" in ref or ref.endswith(".toml"):
        return Path(ref)
    if not re.fullmatch(PROFILE_NAME_RE, ref):
        raise ProfileError(f"invalid profile name {ref[:40]!r} (expecting {PROFILE_NAME_RE}, or a path)")
    for folder in dirs:
        for candidate in (folder / kind / f"{ref}.toml", folder / f"{ref}.toml"):
            if candidate.is_file():
                return candidate
    shipped = resources.files("vbs.profiles").joinpath(kind, f"{ref}.toml")
    if shipped.is_file():
        return Path(str(shipped))
    searched = ", ".join(str(d) for d in dirs) or "no directory"
    raise ProfileError(f"no {kind} profile named {ref!r} in {searched}; shipped: "
                       f"{', '.join(shipped_profiles(kind)) or 'none'}")


class _Checker:
    """Loads one file and names the line of whatever is wrong in it."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    def fail(self, message: str, *needles: str, after: str | None = None) -> ProfileError:
        """``message`` located at the first line holding one of ``needles`` (below the line holding
        ``after``, when given: the table the fault is in)."""
        start = next((n for n, text in enumerate(self.lines) if after in text), 0) if after else 0
        line = next((n for n, text in enumerate(self.lines[start:], start + 1)
                     if any(needle and needle in text for needle in needles)), None)
        where = f"{self.path}, line {line}" if line else str(self.path)
        return ProfileError(f"profile {where}: {message}")


def load_profile(schema: ProfileSchema, ref: str, dirs: Sequence[Path] = (DEFAULT_PROFILE_DIR,)) -> Profile:
    """The profile ``ref`` (a name looked up in ``dirs`` and then among the shipped ones, or a path),
    checked against ``schema``. Anything wrong raises ``ProfileError`` naming the file and line."""
    path = _find(schema.kind, ref, dirs)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    check = _Checker(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid TOML: {exc}") from exc
    name = path.name.removesuffix(".toml")
    if not re.fullmatch(PROFILE_NAME_RE, name):
        raise ProfileError(f"profile {path}: the file name must be NAME.toml with NAME matching {PROFILE_NAME_RE}")
    unknown = set(data) - {"profile", "settings", "commands", "placeholders"}
    if unknown:
        key = sorted(unknown)[0]
        raise check.fail(f"unknown table or key {key!r} (expecting profile, settings, placeholders, commands)",
                         f"[{key}", f"{key} ")
    head = _table(check, data, "profile")
    kind = head.get("kind")
    if kind != schema.kind:
        raise check.fail(f"[profile] kind must be {schema.kind!r}, not {kind!r}", "kind")
    common = {"kind", "description", "timeout", "reject"}
    for key in head:
        if key not in common and key not in schema.options:
            allowed = ", ".join(sorted(common | set(schema.options)))
            raise check.fail(f"unknown key {key!r} in [profile] (expecting {allowed})", f"{key} ", f"{key}=")
    description = head.get("description", "")
    if not isinstance(description, str) or len(description) > 500:
        raise check.fail("[profile] description must be a string of at most 500 characters", "description")
    timeout = _timeout(check, head.get("timeout", 30), "timeout")
    reject = head.get("reject", "")
    if not isinstance(reject, str) or len(reject) > 32:
        raise check.fail("[profile] reject must be a string of characters", "reject")
    options: dict[str, str] = {}
    for key, (pattern, default) in schema.options.items():
        value = head.get(key, default)
        if not isinstance(value, str) or not re.fullmatch(pattern, value):
            raise check.fail(f"[profile] {key} must match {pattern}, not {value!r}", f"{key} ", f"{key}=")
        options[key] = value

    placeholders = dict(LIBRARY)
    own = _table(check, data, "placeholders")
    for key, pattern in own.items():
        if key not in schema.typed_by_profile:
            raise check.fail(f"[placeholders] {key}: only {sorted(schema.typed_by_profile) or 'nothing'} may be "
                             "typed by a profile", f"{key} ", f"{key}=")
        if not isinstance(pattern, str) or not pattern or len(pattern) > 200:
            raise check.fail(f"[placeholders] {key} must be a regular expression", f"{key} ")
        try:
            placeholders[key] = Placeholder(key, "typed by the profile", pattern=pattern)
        except re.error as exc:
            raise check.fail(f"[placeholders] {key} is not a valid regular expression: {exc}", f"{key} ") from exc
    missing_types = schema.typed_by_profile - set(own)
    if missing_types:
        key = sorted(missing_types)[0]
        raise check.fail(f"[placeholders] must give {key!r} its pattern (the ids this profile accepts)",
                         "[placeholders]", "[profile]")

    settings: dict[str, str] = {}
    for key, value in _table(check, data, "settings").items():
        if not re.fullmatch(_FIELD_RE, key):
            raise check.fail(f"invalid setting name {key!r}", f"{key}")
        if key in placeholders:
            raise check.fail(f"setting {key!r} would hide the placeholder {{{key}}} VBS fills in", f"{key} ", f"{key}=")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise check.fail(f"setting {key!r} must be a string or an integer", f"{key} ", f"{key}=")
        text_value = str(value)
        try:
            if not re.fullmatch(_SETTING_RE, text_value):
                raise InvalidParameter(f"must match {_SETTING_RE}")
            check_floor(key, text_value, reject)
        except InvalidParameter as exc:
            raise check.fail(f"setting {key!r} = {text_value[:60]!r}: {exc.message}", f"{key} ", f"{key}=") from exc
        settings[key] = text_value

    commands: dict[str, CommandSpec] = {}
    raw_commands = _table(check, data, "commands")
    for cmd_name, body in raw_commands.items():
        cmd_schema = schema.commands.get(cmd_name)
        if cmd_schema is None:
            raise check.fail(f"unknown command {cmd_name!r} (this kind has: {', '.join(schema.commands)})",
                             f"[commands.{cmd_name}]", f"{cmd_name}")
        commands[cmd_name] = _command(check, cmd_name, body, cmd_schema, timeout, settings, placeholders)
    for cmd_name, cmd_schema in schema.commands.items():
        if cmd_schema.required and cmd_name not in commands:
            raise check.fail(f"the command {cmd_name!r} is missing ([commands.{cmd_name}] with an argv)",
                             "[commands", "[profile]")
    return Profile(name=name, kind=schema.kind, path=path, description=description, options=options,
                   settings=settings, commands=commands, placeholders=placeholders, reject=reject)


def _table(check: _Checker, data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise check.fail(f"{key!r} must be a table ([{key}])", key)
    return value


def _timeout(check: _Checker, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= _MAX_TIMEOUT:
        raise check.fail(f"{where} must be a number of seconds in (0, {_MAX_TIMEOUT:g}]", "timeout")
    return float(value)


def _command(check: _Checker, name: str, body: object, schema: CommandSchema, default_timeout: float,
             settings: Mapping[str, str], placeholders: Mapping[str, Placeholder]) -> CommandSpec:
    def fail(message: str, *needles: str) -> ProfileError:
        return check.fail(message, *needles, after=f"[commands.{name}]")

    if not isinstance(body, dict):
        raise fail(f"[commands.{name}] must be a table", f"commands.{name}")
    unknown = set(body) - {"argv", "then", "timeout", "expect", "lines"}
    if unknown:
        key = sorted(unknown)[0]
        raise fail(f"unknown key {key!r} in [commands.{name}] (expecting argv, then, timeout, expect, lines)",
                   f"{key} ", f"{key}=")

    def strings(items: object, key: str) -> list[str]:
        if (not isinstance(items, list) or not items or len(items) > _MAX_ARGS
                or not all(isinstance(a, str) and a and len(a) <= 1024 for a in items)):
            raise fail(f"[commands.{name}] {key} must be a non-empty list of at most {_MAX_ARGS} strings "
                       "(or { when = PLACEHOLDER, args = [...] } groups)", key)
        return items

    def argv_of(key: str) -> list[Arg]:
        raw = body[key]
        if isinstance(raw, str):
            raise fail(f"[commands.{name}] {key} must be a list of arguments, never a shell line", key)
        if not isinstance(raw, list) or not raw or len(raw) > _MAX_ARGS:
            raise fail(f"[commands.{name}] {key} must be a non-empty list of at most {_MAX_ARGS} arguments", key)
        args: list[Arg] = []
        for item in raw:
            if isinstance(item, dict):
                if set(item) != {"when", "args"} or not isinstance(item["when"], str):
                    raise fail(f"[commands.{name}] a group of {key} is {{ when = PLACEHOLDER, args = [...] }}", "when")
                if item["when"] not in placeholders or item["when"] not in schema.placeholders:
                    raise fail(f"[commands.{name}] unknown placeholder {item['when']!r} in a group's when",
                               str(item["when"]))
                args.append(ArgGroup(item["when"], tuple(strings(item["args"], key))))
            else:
                args.extend(strings([item], key))
        if not isinstance(args[0], str) or not re.fullmatch(r"[A-Za-z0-9_./+-]+", args[0]):
            raise fail(f"[commands.{name}] the program {str(args[0])[:60]!r} must be a fixed name or path",
                       str(args[0]))
        return args

    if "argv" not in body:
        raise fail(f"[commands.{name}] has no argv", f"[commands.{name}]")
    args = argv_of("argv")
    then = argv_of("then") if "then" in body else None
    expect = body.get("expect")
    if expect is not None and (not isinstance(expect, str) or not expect):
        raise fail(f"[commands.{name}] expect must be a non-empty string", "expect")
    lines = body.get("lines")
    pattern: re.Pattern[str] | None = None
    if lines is not None:
        try:
            pattern = re.compile(str(lines))
        except re.error as exc:
            raise fail(f"[commands.{name}] lines is not a valid regular expression: {exc}", "lines") from exc
    timeout = _timeout(check, body.get("timeout", default_timeout), f"[commands.{name}] timeout")
    templates = _flat(args) + _flat(then or []) + ([expect] if expect else [])
    for template in templates:
        try:
            used = _fields_of([template])
        except ValueError as exc:
            raise fail(f"[commands.{name}] {exc} is not a placeholder (write {{name}}; no format, "
                             "index or attribute)", str(exc)) from exc
        for field_name in used:
            if field_name in settings:
                continue
            if field_name not in placeholders or field_name not in schema.placeholders:
                offered = ", ".join(sorted(schema.placeholders | set(settings)))
                raise fail(f"[commands.{name}] unknown placeholder {{{field_name}}} (this command offers: "
                                 f"{offered})", "{" + field_name + "}")
    return CommandSpec(name=name, argv=tuple(args), timeout=timeout, expect=expect, lines=pattern,
                       then=tuple(then) if then else None)
