"""Volume commands: create, delete, describe, modify, attach, detach, migrate a volume, and the tags of
volumes and snapshots."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from vbs.cli import output
from vbs.cli.client import LongPoll, step_progress, wait_for, watch
from vbs.cli.context import (
    Context,
    FilterOpt,
    IdsArg,
    MaxResultsOpt,
    NextTokenOpt,
    TagOpt,
    describe,
    emit_operation,
    tags,
)

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()


@commands.command("create-volume")
def create_volume(
    ctx: typer.Context,
    size: Annotated[int | None, typer.Option("--size", help="Size in GiB.")] = None,
    comment: Annotated[str, typer.Option(help="Free text, up to 255 characters.")] = "",
    snapshot: Annotated[str | None, typer.Option(help="Create from this snapshot.")] = None,
    volume_type: Annotated[str, typer.Option("--type")] = "gp3",
    iops: Annotated[int | None, typer.Option()] = None,
    throughput: Annotated[int | None, typer.Option(help="MB/s")] = None,
    multi_attach: Annotated[bool, typer.Option("--multi-attach", help="io1/io2 only.")] = False,
    encrypted: Annotated[bool, typer.Option("--encrypted", help=(
        "A LUKS container the hypervisor opens: the storage node and the network see only ciphertext."))] = False,
    kms_key_id: Annotated[str | None, typer.Option(help="Recorded with an encrypted volume (default "
                                                        "alias/aws/ebs).")] = None,
    placement: Annotated[str, typer.Option(help="shared | local")] = "shared",
    host: Annotated[str | None, typer.Option(
        "--host", help="local: the hypervisor node whose local pool holds it (attachable there only).")] = None,
    persistent: Annotated[bool, typer.Option(
        "--persistent", help="local: kept at detach (otherwise removed, like an instance store).")] = False,
    tag: TagOpt = None,
    client_token: Annotated[str | None, typer.Option(help="Idempotency token.")] = None,
    availability_zone: Annotated[str | None, typer.Option(help="Place it in this zone.")] = None,
    storage_node: Annotated[str | None, typer.Option(help="Place it on this storage node.")] = None,
    pool: Annotated[str | None, typer.Option(help="Place it in a pool of this name.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until available (progress bar).")] = False,
) -> None:
    """Create a volume (empty, or from a snapshot, where the snapshot lives).

    The scheduler picks the pool with the most room relative to its capacity, within the zone, node
    and pool given."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"comment": comment, "volume_type": volume_type, "multi_attach": multi_attach,
                            "placement": placement, "tags": tags(tag), "encrypted": encrypted}
    if placement == "local" or host is not None or persistent:
        body |= {"host": host, "persistent": persistent}
    for key, value in (("size_gib", size), ("snapshot_id", snapshot), ("iops", iops), ("throughput", throughput),
                       ("kms_key_id", kms_key_id),
                       ("client_token", client_token), ("availability_zone", availability_zone),
                       ("storage_node", storage_node), ("pool", pool)):
        if value is not None:
            body[key] = value
    vol = c.client.call("POST", "/v1/volumes", body)
    if wait:
        vol = wait_for(c.client, f"/v1/volumes/{vol['volume_id']}", busy={"creating"},
                       label=f"creating {vol['volume_id']}", show=c.interactive)
    output.emit(vol, c.fmt, output.VOLUME_COLUMNS)
    if vol["status"] == "error":
        raise typer.Exit(1)


@commands.command("delete-volume")
def delete_volume(ctx: typer.Context, volume_id: str,
                  wait: Annotated[bool, typer.Option("--wait")] = False) -> None:
    """Delete an available volume (its snapshots stay)."""
    c: Context = ctx.obj
    vol = c.client.call("DELETE", f"/v1/volumes/{volume_id}")
    if wait and vol["status"] != "recoverable":  # recoverable: kept in the Recycle Bin, nothing to wait for
        vol = wait_for(c.client, f"/v1/volumes/{volume_id}", busy={"deleting"}, label=f"deleting {volume_id}",
                       show=c.interactive)
    output.emit(vol, c.fmt, output.VOLUME_COLUMNS)


@commands.command("describe-volumes")
def describe_volumes(ctx: typer.Context, volume_ids: IdsArg = None, filter_: FilterOpt = None,
                     max_results: MaxResultsOpt = None, next_token: NextTokenOpt = None) -> None:
    """Describe volumes, by id or by filters (status, snapshot-id, volume-id, size, tag:KEY, tag-key …)."""
    describe(ctx.obj, "volumes", "volume_id", volume_ids, filter_, max_results, next_token, output.VOLUME_COLUMNS)


@commands.command("modify-volume")
def modify_volume(
    ctx: typer.Context,
    volume_id: str,
    size: Annotated[int | None, typer.Option("--size", help="New size in GiB (grow only).")] = None,
    volume_type: Annotated[str | None, typer.Option("--type")] = None,
    iops: Annotated[int | None, typer.Option()] = None,
    throughput: Annotated[int | None, typer.Option(help="MB/s")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the modification completes.")] = False,
) -> None:
    """Grow a volume (also while attached: the guest sees the new size) or change its type."""
    c: Context = ctx.obj
    body = {k: v for k, v in (("size_gib", size), ("volume_type", volume_type), ("iops", iops),
                              ("throughput", throughput)) if v is not None}
    mod = c.client.call("POST", f"/v1/volumes/{volume_id}/modify", body)

    def latest() -> dict[str, Any]:
        found = c.client.call("GET", f"/v1/volume-modifications?volume_id={volume_id}")["modifications"]
        return next(m for m in found if m["modification_id"] == mod["modification_id"])

    if wait:
        mod = watch(latest, first=mod, done=lambda m: m["state"] not in ("modifying", "optimizing"),
                    progress=lambda m: m["progress"], label=f"modifying {volume_id}", show=c.interactive)
    output.emit(mod, c.fmt, output.MODIFICATION_COLUMNS)
    if mod["state"] == "failed":
        raise typer.Exit(1)


@commands.command("attach-volume")
def attach_volume(
    ctx: typer.Context,
    volume_id: str,
    host: Annotated[str | None, typer.Option(help="Hypervisor node (with --vm).")] = None,
    vm: Annotated[str | None, typer.Option(help="VM id on that host (its QMP socket name).")] = None,
    instance: Annotated[str | None, typer.Option(
        help="Instance id i-…, or an external cloud's SCHEME:ID (nova:<uuid>) that a resolver maps "
             "(instead of --host/--vm).")] = None,
    device: Annotated[str, typer.Option(help="Device name to record (the guest picks its own).")] = "vdb",
    read_only: Annotated[bool, typer.Option("--read-only")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until attached.")] = False,
) -> None:
    """Hot-plug a volume into a running VM."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"device": device, "read_only": read_only}
    for key, value in (("host", host), ("vm_id", vm), ("instance_id", instance)):
        if value is not None:
            body[key] = value
    att = c.client.call("POST", f"/v1/volumes/{volume_id}/attach", body)
    for warning in att.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    _show_attachment(c, volume_id, att, wait=wait, busy_state="attaching",
                     failed=lambda state: state not in ("attaching", "attached"))


@commands.command("detach-volume")
def detach_volume(
    ctx: typer.Context,
    volume_id: str,
    instance: Annotated[str | None, typer.Option(help="Instance id, where the volume has several.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Unplug without waiting for the guest.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until detached (or busy).")] = False,
) -> None:
    """Unplug a volume from its VM, then remove its export."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"force": force}
    if instance is not None:
        body["instance_id"] = instance
    att = c.client.call("POST", f"/v1/volumes/{volume_id}/detach", body)
    _show_attachment(c, volume_id, att, wait=wait, busy_state="detaching", failed=lambda state: state == "busy")


def _show_attachment(c: Context, volume_id: str, att: dict[str, Any], *, wait: bool, busy_state: str,
                     failed: Callable[[str], bool]) -> None:
    """Print an attachment, with ``wait`` once it leaves ``busy_state``; exit 1 if its state is ``failed``."""
    if wait:
        att = _wait_attachment(c, volume_id, att, busy_state)
    output.emit(att, c.fmt, output.ATTACHMENT_COLUMNS)
    if failed(att["state"]):
        raise typer.Exit(1)


def _wait_attachment(c: Context, volume_id: str, started: dict[str, Any], busy_state: str) -> dict[str, Any]:
    """Wait until the attachment leaves ``busy_state``, with a bar of its operation's steps; say why if
    its operation failed."""
    op_id = started.get("operation_id")
    # The attachment settles in the transaction that ends its operation: wait on the operation (a
    # long-poll), then read the volume.
    operation = LongPoll(c.client, f"/v1/operations/{op_id}", show=c.interactive) if op_id else None

    def both() -> dict[str, Any]:
        op = operation() if operation is not None else None
        vol = c.client.call("GET", f"/v1/volumes/{volume_id}")
        att = next((a for a in vol["attachments"] if a["attachment_id"] == started["attachment_id"]), None)
        # Gone from the live attachments: detached, or an attach that rolled back.
        return {"att": att if att is not None else {**started, "state": "detached"}, "op": op}

    seen = watch(both, done=lambda x: x["att"]["state"] != busy_state,
                 progress=lambda x: step_progress(x["op"]) if x["op"] else None,
                 label=f"{busy_state} {volume_id}", show=c.interactive, interval=0.1)
    att, op = seen["att"], seen["op"]
    if op is not None and op["status"] in ("running", "rolling-back"):
        op = c.client.call("GET", f"/v1/operations/{op_id}")
    if op is not None and op["status"] in ("rolled-back", "failed"):
        print(f"error: {started['volume_id']}: {op['kind']} {op['status']}: {op['error']}", file=sys.stderr)
        if busy_state == "attaching":
            att = {**att, "state": "failed"}
    return {**att, "operation_id": op_id}


@commands.command("create-tags")
def create_tags(ctx: typer.Context, resource_ids: list[str],
                tag: Annotated[list[str], typer.Option(help="KEY=VALUE, repeatable.")]) -> None:
    """Add or overwrite tags on volumes and snapshots."""
    c: Context = ctx.obj
    # Setting the same tags twice changes nothing: safe to repeat at another endpoint.
    output.emit(c.client.call("POST", "/v1/tags", {"resource_ids": resource_ids, "tags": tags(tag)},
                              idempotent=True), "json")


@commands.command("delete-tags")
def delete_tags(ctx: typer.Context, resource_ids: list[str],
                key: Annotated[list[str] | None, typer.Option(help="Tag key, repeatable; none = all.")] = None) -> None:
    """Remove tags from volumes and snapshots."""
    c: Context = ctx.obj
    output.emit(c.client.call("POST", "/v1/tags/delete", {"resource_ids": resource_ids, "keys": key or []},
                              idempotent=True), "json")


@commands.command("migrate-volume")
def migrate_volume(
    ctx: typer.Context,
    volume_id: str,
    storage_node: Annotated[str, typer.Option(help="The storage node to serve the volume from.")],
    pool: Annotated[str | None, typer.Option(help="Its pool (default: the one of the same shared storage, "
                                                  "else the first of its own with room).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the move is done.")] = False,
) -> None:
    """Serve a volume from another storage node (admin); it keeps its id. Instant for storage the nodes
    share (a Ceph pool); a volume in a pool of files is copied: pulled by the new node if available,
    mirrored by its VM's hypervisor while the guest runs if attached (progress in describe-volumes)."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"storage_node": storage_node}
    if pool is not None:
        body["pool"] = pool
    move = c.client.call("POST", f"/v1/volumes/{volume_id}/migrate", body)
    emit_operation(c, move, wait=wait, label=f"moving {volume_id}")
