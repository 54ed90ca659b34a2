"""Snapshot commands: snapshot one volume or every volume of an instance at one instant, copy, share,
delete and describe snapshots."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
from typing import Annotated, Any

import typer

from vbs.cli import output
from vbs.cli.client import wait_for, wait_gone
from vbs.cli.context import CommentOpt, Context, FilterOpt, IdsArg, MaxResultsOpt, NextTokenOpt, TagOpt, describe, tags

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()

# The --wait of the commands that make one snapshot.
WaitOpt = Annotated[bool, typer.Option("--wait", help="Wait until completed (progress bar).")]


@commands.command("create-snapshot")
def create_snapshot(
    ctx: typer.Context,
    volume_id: str,
    comment: CommentOpt = "",
    tag: TagOpt = None,
    wait: WaitOpt = False,
) -> None:
    """Snapshot a volume (crash-consistent; also of an in-use volume)."""
    c: Context = ctx.obj
    _show_snapshots(c, [c.client.call("POST", "/v1/snapshots", {"volume_id": volume_id, "comment": comment,
                                                                 "tags": tags(tag)})], wait, one=True)


def _show_snapshots(c: Context, snaps: list[dict[str, Any]], wait: bool, *, one: bool = False) -> None:
    """Print new snapshots, once completed with ``wait`` (a progress bar each); exit 1 if one failed."""
    if wait:
        snaps = [wait_for(c.client, f"/v1/snapshots/{s['snapshot_id']}", busy={"pending"},
                          label=f"snapshot {s['snapshot_id']}", show=c.interactive) for s in snaps]
    output.emit(snaps[0] if one else snaps, c.fmt, output.SNAPSHOT_COLUMNS)
    if any(s["status"] == "error" for s in snaps):
        raise typer.Exit(1)


@commands.command("create-snapshots")
def create_snapshots(
    ctx: typer.Context,
    instance_id: str,
    comment: CommentOpt = "",
    tag: TagOpt = None,
    copy_volume_tags: Annotated[bool, typer.Option("--copy-volume-tags", help="Each snapshot gets its volume's "
                                                                               "tags too.")] = False,
    exclude: Annotated[list[str] | None, typer.Option(help="A volume id to leave out; repeatable.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until all are completed (progress bar).")] = False,
) -> None:
    """Snapshot every volume attached to an instance at one instant (crash-consistent as a set: the VM
    pauses while the storage nodes take them, milliseconds on reflink pools)."""
    c: Context = ctx.obj
    made = c.client.call("POST", "/v1/snapshot-sets", {"instance_id": instance_id, "comment": comment,
                                                       "tags": tags(tag), "copy_tags_from_volume": copy_volume_tags,
                                                       "exclude_volume_ids": exclude or []})["snapshots"]
    _show_snapshots(c, made, wait)


@commands.command("copy-snapshot")
def copy_snapshot(
    ctx: typer.Context,
    snapshot_id: str,
    comment: CommentOpt = "",
    tag: TagOpt = None,
    encrypted: Annotated[bool, typer.Option("--encrypted", help="Encrypt the copy (a copy of an encrypted "
                                                                "snapshot is encrypted anyway).")] = False,
    kms_key_id: Annotated[str | None, typer.Option(help="Another KMS key id: the copy is re-encrypted under a new "
                                                        "data key.")] = None,
    wait: WaitOpt = False,
) -> None:
    """Copy a snapshot (yours, or one shared with you) into a new snapshot of yours; with --encrypted (or
    another --kms-key-id) re-encrypted under a new key."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"source_snapshot_id": snapshot_id, "comment": comment, "tags": tags(tag),
                            "encrypted": encrypted}
    if kms_key_id is not None:
        body["kms_key_id"] = kms_key_id
    _show_snapshots(c, [c.client.call("POST", "/v1/snapshot-copies", body)], wait, one=True)


@commands.command("share-snapshot")
def share_snapshot(
    ctx: typer.Context,
    snapshot_id: str,
    with_: Annotated[list[str] | None, typer.Option("--with", help="A tenant, or all; repeatable.")] = None,
    revoke: Annotated[list[str] | None, typer.Option(help="A tenant (or all) to stop sharing with; repeatable.")]
    = None,
) -> None:
    """Let other tenants make volumes from (and copy) a snapshot of yours; without options, show who may."""
    c: Context = ctx.obj
    path = f"/v1/snapshots/{snapshot_id}/permissions"
    if with_ or revoke:
        out = c.client.call("POST", path, {"add": with_ or [], "remove": revoke or []})
    else:
        out = c.client.call("GET", path)
    output.emit(out, c.fmt, output.PERMISSION_COLUMNS)


@commands.command("delete-snapshot")
def delete_snapshot(ctx: typer.Context, snapshot_id: str,
                    wait: Annotated[bool, typer.Option("--wait", help="Wait until it is deleted.")] = False) -> None:
    """Delete a snapshot (volumes made from it stay)."""
    c: Context = ctx.obj
    snap = c.client.call("DELETE", f"/v1/snapshots/{snapshot_id}")
    if wait:
        snap = wait_gone(c.client, f"/v1/snapshots/{snapshot_id}", snap, label=f"deleting {snapshot_id}",
                         show=c.interactive)
    output.emit(snap, c.fmt, output.SNAPSHOT_COLUMNS)


@commands.command("describe-snapshots")
def describe_snapshots(ctx: typer.Context, snapshot_ids: IdsArg = None, filter_: FilterOpt = None,
                       max_results: MaxResultsOpt = None, next_token: NextTokenOpt = None) -> None:
    """Describe snapshots, by id or by filters (status, volume-id, tag:KEY …)."""
    describe(ctx.obj, "snapshots", "snapshot_id", snapshot_ids, filter_, max_results, next_token,
             output.SNAPSHOT_COLUMNS)


commands.command("describe-snapshot", help="Alias of describe-snapshots (the paper's name).")(describe_snapshots)
