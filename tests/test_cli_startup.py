"""The CLI's start-up, by structure (its speed is bench/cli_startup.py's business): a client command
loads none of the services' modules, and building only the command a line names changes nothing
that line does, ``vbs --help`` still listing every command."""

from __future__ import annotations

import inspect
import json
import os
import re
import ssl
import subprocess
import sys

import pytest
import typer

from tests.conftest import VBS, free_port
from vbs.cli.main import _listed, app, app_for, command_name
from vbs.trust.tls import client_verify

# What the services run on: a client command has no use for any of it.
SERVER_SIDE = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "qemu", "libvirt",
               "prometheus_client", "cryptography", "vbs.controller", "vbs.storage", "vbs.host", "vbs.net.web",
               "vbs.config", "vbs.trust.pki")
# What only some commands need: a table (rich), --query (jmespath), YAML, the HTTP client.
ON_DEMAND = ("rich", "pygments", "markdown_it", "jmespath", "yaml", "httpx", "pydantic")


def loaded_modules(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter has loaded once ``code`` has run (whatever it exits with)."""
    dump = "import atexit, json, sys; atexit.register(lambda: print(json.dumps(sorted(sys.modules))))\n"
    proc = subprocess.run([sys.executable, "-c", dump + code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def among(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m in packages or m.startswith(tuple(f"{p}." for p in packages)))


@pytest.mark.unit
def test_importing_the_cli_loads_neither_the_services_nor_what_only_some_commands_need() -> None:
    modules = loaded_modules("import vbs.cli.main")
    assert "typer" in modules  # the check sees what was imported
    assert among(modules, SERVER_SIDE + ON_DEMAND) == []


@pytest.mark.unit
def test_a_client_command_loads_no_server_side_module() -> None:
    # describe-volumes against a port nothing listens on: the whole client path runs (options, profile,
    # key, the HTTP client, the request), up to the connection refused.
    code = ("import sys\nfrom vbs.cli.main import main\n"
            f"sys.argv = ['vbs', '-o', 'json', 'describe-volumes', '--endpoint', 'http://127.0.0.1:{free_port()}']\n"
            "main()\n")
    modules = loaded_modules(code, {"VBS_ACCESS_KEY_ID": "AKIDEXAMPLE", "VBS_SECRET_ACCESS_KEY": "secret"})
    assert {"httpx", "vbs.net.api_client"} <= modules  # the request was made
    assert among(modules, SERVER_SIDE) == []
    # httpx's own command line (rich, pygments) stays out; a JSON answer draws no table; its options are
    # text and an absent integer, which Typer would read through Pydantic (vbs.cli.params).
    assert among(modules, ("rich", "pygments", "click", "jmespath", "yaml", "pydantic")) == []


def command_names(typer_app: typer.Typer) -> list[str]:
    return [command_name(c) for c in typer_app.registered_commands] + [
        g.name for g in typer_app.registered_groups if g.name]


@pytest.mark.unit
def test_help_lists_every_command_with_its_summary() -> None:
    proc = subprocess.run([*VBS, "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    listing = proc.stdout.split("\nCommands:\n", 1)[1]
    listed = [line.split()[0] for line in listing.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    names = command_names(app)
    assert len(names) > 30 and listed == names
    # Each with the first paragraph of its help, not click's 45-character cut. (Click may wrap a line
    # after a hyphen, "re-" then "encrypted": spaces after hyphens do not count on either side.)
    def flow(text: str) -> str:
        return re.sub(r"-\s+", "-", " ".join(text.split()))

    flowing = flow(listing)
    for command in app.registered_commands:
        text = command.help or inspect.getdoc(command.callback) or ""
        assert flow(text.partition("\n\n")[0]) in flowing, command.name
    assert "The metadata database: its schema revision and upgrades." in flowing


@pytest.mark.unit
def test_a_line_that_names_a_command_builds_that_command_alone_and_the_same() -> None:
    whole = typer.main.get_command(app)
    assert isinstance(whole, typer.core.TyperGroup)
    for name in command_names(app):
        one = app_for(["--output", "json", name, "--help"])
        assert command_names(one) == [name]
        built = typer.main.get_command(one)
        assert isinstance(built, typer.core.TyperGroup)
        # Same options of the CLI, same command: its parameters, their names and declarations.
        assert [p.opts for p in built.params] == [p.opts for p in whole.params]
        assert ([(p.name, p.opts, p.required) for p in built.commands[name].params]
                == [(p.name, p.opts, p.required) for p in whole.commands[name].params]), name


@pytest.mark.unit
@pytest.mark.parametrize("argv", [[], ["--help"], ["--help", "describe-volumes"], ["--output", "json"],
                                  ["--install-completion"]])
def test_a_line_that_runs_no_command_gets_every_command_by_name_and_help_only(
        argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("_VBS_COMPLETE", raising=False)
    listed = app_for(argv)
    assert command_names(listed) == command_names(app)
    assert all(c.callback is _listed for c in listed.registered_commands)  # no parameter to read
    built, whole = typer.main.get_command(listed), typer.main.get_command(app)
    assert isinstance(built, typer.core.TyperGroup) and isinstance(whole, typer.core.TyperGroup)
    assert [p.opts for p in built.params] == [p.opts for p in whole.params]
    for name, command in whole.commands.items():
        assert built.commands[name].get_short_help_str(300) == command.get_short_help_str(300), name
    # Shell completion completes a command's options: it needs the real commands.
    monkeypatch.setenv("_VBS_COMPLETE", "complete_bash")
    assert app_for(argv) is app


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["describe-volumz"], ["--bogus", "describe-volumes"]])
def test_a_misspelt_command_or_an_unknown_option_before_it_gets_the_whole_app(argv: list[str]) -> None:
    # click suggests the nearest command, or names the options there are.
    assert app_for(argv) is app


@pytest.mark.unit
def test_help_as_the_value_of_an_option_is_no_request_for_help() -> None:
    one = app_for(["--query", "--help", "describe-volumes"])
    assert command_names(one) == ["describe-volumes"]
    assert one.registered_commands[0].callback is not _listed  # the real command, which then runs


@pytest.mark.unit
def test_a_plain_http_client_loads_no_trust_store_and_still_refuses_tls() -> None:
    ctx = client_verify(None, https=False)
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] == 0  # trusts nothing: a TLS connection would fail
    assert client_verify(None) is True  # https: the system's trust store, as before
