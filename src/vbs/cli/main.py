"""The ``vbs`` executable: the app that the commands of vbs.cli's modules join, its global options, and
``main`` (argv hoisted, only the command the line names built, every error one line).

Client commands talk to a controller (``--endpoint`` or ``VBS_ENDPOINT``, default
``http://127.0.0.1:8770``; several separated by commas, tried in turn when one fails); they print a
table on a terminal and JSON otherwise (``--output``).
"""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
import copy
import inspect
import logging
import os
import re
import sys
from typing import Annotated

import typer
from typer.models import CommandInfo

from vbs.cli import admin, csi, demo_vm, nodes, output, policies, recycle_bin, services, snapshots, volumes
from vbs.cli.argv_hoisting import asks_help, command_index, hoist_global_options, only_global_options
from vbs.cli.context import Context
from vbs.cli.database import db_app
from vbs.errors import VbsError
from vbs.net.endpoints import DEFAULT_CONTROLLER_PORT

# Start-up is paid on every command: these modules import only what every command needs (typer, the
# client plumbing's light parts); httpx and the rest load where a command uses them, and the services'
# modules (FastAPI, SQLAlchemy, QMP, libvirt, ...) only in the commands that run a service
# (tests/test_cli_startup.py checks it).


def _light_params() -> None:
    """Plain-text values without Pydantic (vbs.cli.params), on the Typer it was written for; any other
    Typer reads them its own way."""
    try:
        from vbs.cli import params
    except (ImportError, AttributeError):
        return
    params.install()


_light_params()

# Help in click's plain layout (rich_markup_mode=None): Typer's Rich panels cost more than the rest
# of ``vbs --help`` together (importing Rich, Markdown and Pygments, then rendering).
app = typer.Typer(no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="VBS — the Virtual Block Store.")
app.add_typer(db_app, name="db")


# The order ``vbs --help`` lists the commands in: the user's verbs (volumes, hosts, snapshots, nodes), the
# admin's, the services, then node credentials. A command missing here fails at import.
_ORDER = (
    "create-volume", "delete-volume", "describe-volumes", "modify-volume", "attach-volume", "detach-volume",
    "describe-hosts", "advise", "describe-instances", "create-snapshot", "create-snapshots", "copy-snapshot",
    "share-snapshot", "delete-snapshot", "describe-snapshots", "describe-snapshot", "list-snapshot-blocks",
    "list-changed-blocks", "lock-snapshot", "unlock-snapshot", "describe-locked-snapshots", "archive-snapshot",
    "restore-snapshot-tier", "describe-snapshot-tier-status", "create-rule", "list-rules", "get-rule", "update-rule",
    "delete-rule", "tag-rule", "untag-rule", "lock-rule", "unlock-rule", "list-snapshots-in-recycle-bin",
    "restore-snapshot-from-recycle-bin",
    "list-volumes-in-recycle-bin", "restore-volume-from-recycle-bin", "create-tags",
    "delete-tags",
    "create-lifecycle-policy", "get-lifecycle-policies", "get-lifecycle-policy", "update-lifecycle-policy",
    "delete-lifecycle-policy", "describe-policy-runs",
    "describe-storage-nodes", "describe-controllers", "drain-storage-node", "migrate-volume", "migrate-instance",
    "describe-availability-zones", "check", "create-key", "delete-key", "describe-keys", "describe-operation",
    "controller", "storage-agent", "host-agent", "up", "csi", "demo-vm", "bootstrap-key", "node-token", "issue-cert",
    "rotate-keys",
)
app.registered_commands = sorted(
    (command for module in (volumes, nodes, snapshots, recycle_bin, policies, admin, services, csi, demo_vm)
     for command in module.commands.registered_commands),
    key=lambda command: _ORDER.index(command.name or ""))


def _print_version(asked: bool) -> None:
    if asked:
        from vbs.versions import RELEASE, WIRE_VERSION

        print(f"vbs {RELEASE} (wire version {WIRE_VERSION})")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="Print VBS's release and wire version (docs/install.md, \"Upgrades\") and exit.")] = False,
    endpoint: Annotated[str | None, typer.Option(envvar="VBS_ENDPOINT", help=(
        "Controller URL, or several separated by commas (the next is tried when one fails); default: the "
        f"profile's, else http://127.0.0.1:{DEFAULT_CONTROLLER_PORT}."))] = None,
    profile: Annotated[str | None, typer.Option(envvar="VBS_PROFILE", help=(
        "A named profile of ~/.config/vbs/config (endpoint, ca_bundle) with its key in "
        "~/.config/vbs/credentials, as the AWS CLI's."))] = None,
    output_format: Annotated[str, typer.Option(
        "--output", "-o", help="auto | table | json | yaml | text (auto: a table on a terminal, else JSON)")] = "auto",
    ca_bundle: Annotated[str | None, typer.Option(envvar="VBS_CA_BUNDLE",
                                                  help="CA certificate to verify an https endpoint with.")] = None,
    query: Annotated[str | None, typer.Option(
        help="A JMESPath expression applied to the answer before it is printed, as the AWS CLI's --query "
             "(e.g. \"volumes[?status=='available'].volume_id\").")] = None,
    no_paginate: Annotated[bool, typer.Option(
        "--no-paginate", help="Describe commands: the first page only (and its next token), not every page.")]
    = False,
    columns: Annotated[str | None, typer.Option(
        help="Tables: these columns, comma-separated (e.g. VolumeId,Status,Size,Tags); default: what fits the "
             "terminal, most important first.")] = None,
    region: Annotated[str | None, typer.Option(envvar="VBS_REGION", help=(
        "The region to act in: the profile's endpoint_<region> if it has one, and the controller must serve it "
        "(default: the profile's region; no check without one)."))] = None,
) -> None:
    if region is not None:
        from vbs.cli.profiles import REGION_RE

        if not re.fullmatch(REGION_RE, region):
            raise typer.BadParameter("--region must be 1-32 characters of a-z, 0-9 and -")
    if output_format not in output.FORMATS:
        raise typer.BadParameter(f"--output must be one of {', '.join(output.FORMATS)}")
    try:
        output.configure(output_format, query, columns)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    ctx.obj = Context(endpoint, output_format, ca_bundle, paginate=not no_paginate, profile=profile, region=region)


def command_name(command: CommandInfo) -> str:
    """What a command is called on the line: its given name, else Typer's from its function's."""
    return command.name or typer.main.get_command_name(getattr(command.callback, "__name__", ""))


def app_for(argv: list[str]) -> typer.Typer:
    """The app that runs ``argv``: the global options and the one command the line names, or the whole
    app where it names none, a misspelt one, or asks before it for something else (``vbs --help
    describe-volumes``). Typer builds the click form of every command it holds from its signature,
    on every run: one command costs a fraction of all of them."""
    pos = command_index(argv)
    if (pos >= len(argv) or asks_help(argv[:pos])) and not any(k.endswith("_COMPLETE") for k in os.environ):
        return _listing()  # no command runs: the root help, a usage error, or the global options alone
    if pos >= len(argv) or not only_global_options(argv[:pos]):
        return app
    commands = [c for c in app.registered_commands if command_name(c) == argv[pos]]
    groups = [g for g in app.registered_groups if g.name == argv[pos]]
    if not commands and not groups:
        return app
    one = copy.copy(app)
    one.registered_commands, one.registered_groups = commands, groups
    return one


def _listing() -> typer.Typer:
    """The app with every command as its name and help only, for a line that runs none of them: the
    root help lists them all, and their parameters (most of the cost of building a command) are not
    read. Shell completion (``_VBS_COMPLETE``) completes a command's options: it gets the whole app."""
    listed = copy.copy(app)
    listed.registered_commands = []
    for command in app.registered_commands:
        stub = copy.copy(command)
        stub.name = command_name(command)
        stub.help = command.help or inspect.getdoc(command.callback)
        stub.callback = _listed
        listed.registered_commands.append(stub)
    return listed


def _listed() -> None:
    raise AssertionError("a command of the listing ran")  # app_for gives the listing to lines that run none


def _summarise_commands(*apps: typer.Typer) -> None:
    """Each command's line in a group's help: the first paragraph of its help, in full (click's own
    summary stops at about 45 characters)."""
    def first_paragraph(text: object) -> str | None:  # a help text, or Typer's placeholder of none
        if not isinstance(text, str):
            return None
        return " ".join(text.partition("\n\n")[0].split()) or None

    for each in apps:
        for command in each.registered_commands:
            if command.short_help is None and command.callback is not None:
                command.short_help = first_paragraph(command.help or inspect.getdoc(command.callback))
        for group in each.registered_groups:
            if not isinstance(group.short_help, str) and group.typer_instance is not None:
                group.short_help = first_paragraph(group.typer_instance.info.help)


def main() -> None:
    # A client that moves on to another endpoint says so on stderr (vbs.net.api_client logs it); the services
    # replace this with their own logging (vbs.system.logs).
    logging.basicConfig(level=logging.WARNING, format="vbs: %(message)s")
    sys.argv[1:] = hoist_global_options(sys.argv[1:])
    # Typer carries its own copy of click (typer==0.29 is pinned): its errors are these classes.
    from typer._click import exceptions as click

    try:
        _summarise_commands(app, db_app)
        code = app_for(sys.argv[1:])(prog_name="vbs", standalone_mode=False)
    except click.NoArgsIsHelpError as exc:
        print(exc.format_message())
        sys.exit(0)
    except click.UsageError as exc:
        # One line, as every error of this CLI: what is wrong, and where the help is.
        where = exc.ctx.command_path if exc.ctx is not None else "vbs"
        message = " ".join(exc.format_message().split())
        print(f"error: InvalidParameterValue: {message} (see: {where} --help)", file=sys.stderr)
        sys.exit(2)
    except click.ClickException as exc:
        print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except VbsError as exc:
        hint = _auth_hint() if exc.code == "AuthFailure" else (
            _HINTS.get(exc.code) or _HINTS.get(exc.code.split(".")[-1], ""))
        print(f"error: {exc.code}: {in_cli_words(exc.message)}{f' (hint: {hint})' if hint else ''}",
              file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


# What to try next, by error code (the message says what is wrong); a code's last part as a fallback.
_HINTS = {
    "InvalidVolume.NotFound": "vbs describe-volumes lists your volumes",
    "InvalidSnapshot.NotFound": "vbs describe-snapshots lists your snapshots",
    "InvalidInstanceID.NotFound": "vbs describe-instances lists the VMs with VBS disks",
    "InvalidOperation.NotFound": "vbs describe-volumes and describe-snapshots name each one's operation",
    "InvalidAttachment.NotFound": "vbs describe-volumes shows each volume's attachments",
    "InvalidHost.NotFound": "vbs describe-hosts lists the hypervisor nodes",
    "InvalidStorageNode.NotFound": "vbs describe-storage-nodes lists the storage nodes",
    "InvalidPool.NotFound": "vbs describe-storage-nodes lists each node's pools",
    "InvalidAccessKeyId.NotFound": "vbs describe-keys lists the access keys",
    "NotFound": "vbs describe-volumes and describe-snapshots list what exists",
    "UnauthorizedOperation": "an admin key can; vbs create-key makes one",
    "AgentUnavailable": "is the controller running? (vbs up starts one; --endpoint points elsewhere)",
    "IncorrectState": "vbs describe-volumes shows its status and attachments",
    "VolumeInUse": "detach it first: vbs detach-volume",
}


# The REST body's fields as this CLI's options name them: an error from the API speaks of the field.
_FLAGS = {"size_gib": "--size", "volume_type": "--type", "snapshot_id": "--snapshot", "multi_attach": "--multi-attach",
          "kms_key_id": "--kms-key-id", "client_token": "--client-token", "availability_zone": "--availability-zone",
          "storage_node": "--storage-node", "instance_id": "--instance", "read_only": "--read-only",
          "copy_tags_from_volume": "--copy-volume-tags", "exclude_volume_ids": "--exclude",
          "max_results": "--max-results"}
_FIELD_RE = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")


def in_cli_words(message: str) -> str:
    """``Invalid value for size_gib`` → ``Invalid value for --size``."""
    return _FIELD_RE.sub(lambda m: _FLAGS[m.group(1)], message)


def _auth_hint() -> str:
    """Where the CLI looked for its key, by the files' real names."""
    from vbs.trust.credentials import user_file

    return ("check VBS_ACCESS_KEY_ID/VBS_SECRET_ACCESS_KEY, --profile, or the key vbs up recorded for this "
            f"endpoint in {user_file()} (the install's own key is in its DIR/credentials, ./var/credentials "
            "by default)")
