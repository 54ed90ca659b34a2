"""Snapshot commands: snapshot one volume or every volume of an instance at one instant, copy, share,
delete and describe snapshots, lock them against deletion, move them to the archive tier and back, and list
their blocks (the EBS direct APIs' ListSnapshotBlocks and ListChangedBlocks)."""

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
    if wait and snap["status"] != "recoverable":  # recoverable: kept in the Recycle Bin, nothing to wait for
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


StartOpt = Annotated[int, typer.Option("--starting-block-index", help="List from this block index on.")]


def _blocks(c: Context, path: str, params: dict[str, str], key: str) -> None:
    out = c.client.call("GET", path, params=params)
    if output.is_machine(c.fmt):
        output.emit(out, c.fmt)
        return
    output.emit(out[key], c.fmt, output.BLOCK_COLUMNS)
    if out.get("NextToken"):
        print(f"next token: {out['NextToken']}")


@commands.command("list-snapshot-blocks")
def list_snapshot_blocks(ctx: typer.Context, snapshot_id: str, starting_block_index: StartOpt = 0,
                         max_results: MaxResultsOpt = None, next_token: NextTokenOpt = None) -> None:
    """The 512 KiB blocks of a stored snapshot that hold data, with the tokens that read them (EBS direct
    APIs' ListSnapshotBlocks; GetSnapshotBlock reads one)."""
    params = {"startingBlockIndex": str(starting_block_index), **_paging(max_results, next_token)}
    _blocks(ctx.obj, f"/snapshots/{snapshot_id}/blocks", params, "Blocks")


@commands.command("list-changed-blocks")
def list_changed_blocks(ctx: typer.Context, second_snapshot_id: str,
                        first: Annotated[str | None, typer.Option("--first", help="The earlier snapshot of the same "
                                                                  "volume (none: every block of the second).")] = None,
                        starting_block_index: StartOpt = 0, max_results: MaxResultsOpt = None,
                        next_token: NextTokenOpt = None) -> None:
    """The blocks that differ between two snapshots of one volume (EBS direct APIs' ListChangedBlocks)."""
    params = {"startingBlockIndex": str(starting_block_index), **_paging(max_results, next_token)}
    if first is not None:
        params["firstSnapshotId"] = first
    _blocks(ctx.obj, f"/snapshots/{second_snapshot_id}/changedblocks", params, "ChangedBlocks")


def _paging(max_results: int | None, next_token: str | None) -> dict[str, str]:
    out = {"maxResults": str(max_results)} if max_results is not None else {}
    return out | ({"pageToken": next_token} if next_token is not None else {})


@commands.command("lock-snapshot")
def lock_snapshot(
    ctx: typer.Context, snapshot_id: str,
    mode: Annotated[str, typer.Option("--mode", help="governance (its owner may unlock it) or compliance (nobody "
                                      "may, once its cooling-off period is over).")],
    duration_days: Annotated[int | None, typer.Option("--duration-days", help="Locked for this many days.")] = None,
    expires_at: Annotated[str | None, typer.Option("--expires-at", help="Locked until this UTC time "
                                                   "(2027-01-31T00:00:00Z).")] = None,
    cool_off_hours: Annotated[int | None, typer.Option("--cool-off-hours", help="compliance: hours during which "
                                                       "the lock may still be removed or changed.")] = None,
) -> None:
    """Lock a snapshot against deletion (by anyone, an admin too), or change its lock."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"mode": mode}
    for key, value in (("duration_days", duration_days), ("expires_at", expires_at),
                       ("cool_off_hours", cool_off_hours)):
        if value is not None:
            body[key] = value
    output.emit(c.client.call("PUT", f"/v1/snapshots/{snapshot_id}/lock", body), c.fmt, output.LOCK_COLUMNS)


@commands.command("unlock-snapshot")
def unlock_snapshot(ctx: typer.Context, snapshot_id: str) -> None:
    """Remove a snapshot's lock (governance, or compliance within its cooling-off period)."""
    c: Context = ctx.obj
    output.emit(c.client.call("DELETE", f"/v1/snapshots/{snapshot_id}/lock"), c.fmt)


@commands.command("describe-locked-snapshots")
def describe_locked_snapshots(
    ctx: typer.Context, snapshot_ids: IdsArg = None,
    state: Annotated[list[str] | None, typer.Option("--state", help="compliance, governance, compliance-cooloff "
                                                    "or expired; repeatable.")] = None,
) -> None:
    """The locks of your snapshots."""
    c: Context = ctx.obj
    params = [("snapshot_id", i) for i in snapshot_ids or []] + [("state", x) for x in state or []]
    out = c.client.call("GET", "/v1/snapshot-locks", params=params)
    output.emit(out if output.is_machine(c.fmt) else out["locks"], c.fmt, output.LOCK_COLUMNS)


@commands.command("archive-snapshot")
def archive_snapshot(ctx: typer.Context, snapshot_id: str) -> None:
    """Move a snapshot to the archive tier (its pool's fast copy goes; restore it to make volumes from it)."""
    c: Context = ctx.obj
    output.emit(c.client.call("PUT", f"/v1/snapshots/{snapshot_id}/tier", {"tier": "archive"}), c.fmt)


@commands.command("restore-snapshot-tier")
def restore_snapshot_tier(
    ctx: typer.Context, snapshot_id: str,
    days: Annotated[int | None, typer.Option("--days", help="Back in the standard tier for this many days.")] = None,
    permanent: Annotated[bool, typer.Option("--permanent", help="Back in the standard tier for good.")] = False,
) -> None:
    """Bring an archived snapshot back to the standard tier, for some days or for good."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"permanent": permanent} | ({"temporary_days": days} if days is not None else {})
    output.emit(c.client.call("POST", f"/v1/snapshots/{snapshot_id}/tier-restores", body), c.fmt)


@commands.command("describe-snapshot-tier-status")
def describe_snapshot_tier_status(ctx: typer.Context, snapshot_ids: IdsArg = None) -> None:
    """The storage tier of your snapshots and their last tiering operation."""
    c: Context = ctx.obj
    out = c.client.call("GET", "/v1/snapshot-tiers", params=[("snapshot_id", i) for i in snapshot_ids or []])
    output.emit(out if output.is_machine(c.fmt) else out["tiers"], c.fmt, output.TIER_COLUMNS)
