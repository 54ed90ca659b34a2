"""Recycle Bin commands (docs/recycle-bin.md): retention rules that keep deleted snapshots and volumes for a
while, and the snapshots and volumes in the bin, listed and restored."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature (vbs.cli.snapshots).
from typing import Annotated, Any

import typer

from vbs.cli import output
from vbs.cli.context import Context, IdsArg, TagOpt, pages, tags
from vbs.cli.output import Column, field

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()

RULE_COLUMNS: list[Column] = [
    field("RuleId", "rule_id"),
    field("Type", "resource_type"),
    ("Retention", lambda r: f"{r['retention_days']} days"),
    ("Matches", lambda r: ", ".join(_tag_text(t) for t in r["resource_tags"]) or "every resource"
     + (f" but {', '.join(_tag_text(t) for t in r['exclude_resource_tags'])}" if r["exclude_resource_tags"] else "")),
    field("State", "lock_state"),
    ("UnlockedAt", lambda r: r.get("lock_end_time") or ""),
    field("Description", "description"),
]
BIN_SNAPSHOT_COLUMNS: list[Column] = [
    field("SnapshotId", "snapshot_id"), field("VolumeId", "volume_id"), field("Deleted", "entered_at"),
    field("GoneAt", "exits_at"), field("Description", "description"),
]
BIN_VOLUME_COLUMNS: list[Column] = [
    field("VolumeId", "volume_id"), ("Size", lambda v: f"{v['size_gib']} GiB"), field("Type", "volume_type"),
    field("Deleted", "entered_at"), field("GoneAt", "exits_at"),
]

ResourceTagOpt = Annotated[list[str] | None, typer.Option(
    "--resource-tag", help="KEY=VALUE (or KEY: any value): the rule keeps resources with any of these tags; "
                           "repeatable. None: every resource (a region-level rule).")]
ExcludeTagOpt = Annotated[list[str] | None, typer.Option(
    "--exclude-tag", help="KEY=VALUE (or KEY): a region-level rule does not keep resources with one of these; "
                          "repeatable.")]
TypeOpt = Annotated[str, typer.Option("--resource-type", help="EBS_SNAPSHOT or EBS_VOLUME.")]


def _tag_text(t: dict[str, Any]) -> str:
    return t["key"] if t.get("value") is None else f"{t['key']}={t['value']}"


def _resource_tags(values: list[str] | None) -> list[dict[str, Any]]:
    out = []
    for item in values or []:
        key, sep, value = item.partition("=")
        if not key:
            raise typer.BadParameter(f"resource tag {item!r} must be KEY=VALUE or KEY")
        out.append({"key": key, "value": value if sep else None})
    return out


def _emit_rule(c: Context, rule: dict[str, Any]) -> None:
    output.emit(rule, c.fmt, RULE_COLUMNS)


@commands.command("create-rule")
def create_rule(
    ctx: typer.Context, resource_type: TypeOpt,
    retention_days: Annotated[int, typer.Option("--retention-days", help="Days a deleted resource is kept "
                                                "(1-3650).")],
    resource_tag: ResourceTagOpt = None, exclude_tag: ExcludeTagOpt = None,
    description: Annotated[str, typer.Option()] = "",
    unlock_delay_days: Annotated[int | None, typer.Option("--lock-unlock-delay-days", help=(
        "Lock the rule (region-level rules only): unlocking it then takes this many days (7-30).")) ] = None,
    tag: TagOpt = None,
) -> None:
    """A retention rule of the Recycle Bin: deletes of the snapshots or volumes it matches keep them for its
    retention, restorable, before they are really deleted."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"resource_type": resource_type, "retention_days": retention_days,
                            "description": description, "resource_tags": _resource_tags(resource_tag),
                            "exclude_resource_tags": _resource_tags(exclude_tag), "tags": tags(tag)}
    if unlock_delay_days is not None:
        body["unlock_delay_days"] = unlock_delay_days
    _emit_rule(c, c.client.call("POST", "/v1/recycle-bin/rules", body))


@commands.command("list-rules")
def list_rules(ctx: typer.Context, resource_type: TypeOpt,
               lock_state: Annotated[str | None, typer.Option("--lock-state", help="locked, pending_unlock or "
                                                              "unlocked.")] = None) -> None:
    """Your retention rules of one resource type."""
    c: Context = ctx.obj
    params = [("resource_type", resource_type)] + ([("lock_state", lock_state)] if lock_state else [])
    body = pages(c, "/v1/recycle-bin/rules", "rules", params)
    output.emit(body if output.is_machine(c.fmt) else body["rules"], c.fmt, RULE_COLUMNS)


@commands.command("get-rule")
def get_rule(ctx: typer.Context, rule_id: str) -> None:
    """One retention rule."""
    c: Context = ctx.obj
    _emit_rule(c, c.client.call("GET", f"/v1/recycle-bin/rules/{rule_id}"))


@commands.command("update-rule")
def update_rule(
    ctx: typer.Context, rule_id: str,
    retention_days: Annotated[int | None, typer.Option("--retention-days")] = None,
    description: Annotated[str | None, typer.Option()] = None,
    resource_tag: ResourceTagOpt = None, exclude_tag: ExcludeTagOpt = None,
) -> None:
    """Change a rule's retention, description or tags (a locked rule: its description only)."""
    c: Context = ctx.obj
    body: dict[str, Any] = {k: v for k, v in (("retention_days", retention_days), ("description", description))
                            if v is not None}
    if resource_tag is not None:
        body["resource_tags"] = _resource_tags(resource_tag)
    if exclude_tag is not None:
        body["exclude_resource_tags"] = _resource_tags(exclude_tag)
    _emit_rule(c, c.client.call("PATCH", f"/v1/recycle-bin/rules/{rule_id}", body))


@commands.command("delete-rule")
def delete_rule(ctx: typer.Context, rule_id: str) -> None:
    """Delete an unlocked rule (what it kept stays in the bin until its own retention ends)."""
    c: Context = ctx.obj
    c.client.call("DELETE", f"/v1/recycle-bin/rules/{rule_id}")
    output.emit({"rule_id": rule_id, "deleted": True}, c.fmt)


@commands.command("tag-rule")
def tag_rule(ctx: typer.Context, rule_id: str,
             tag: Annotated[list[str], typer.Option(help="KEY=VALUE, repeatable.")]) -> None:
    """Add or overwrite tags of a rule itself (not the tags it matches)."""
    c: Context = ctx.obj
    output.emit(c.client.call("POST", f"/v1/recycle-bin/rules/{rule_id}/tags", {"tags": tags(tag)}), c.fmt)


@commands.command("untag-rule")
def untag_rule(ctx: typer.Context, rule_id: str,
               key: Annotated[list[str], typer.Option(help="A tag key to remove, repeatable.")]) -> None:
    """Remove tags of a rule itself."""
    c: Context = ctx.obj
    output.emit(c.client.call("DELETE", f"/v1/recycle-bin/rules/{rule_id}/tags", params=[("key", k) for k in key]),
                c.fmt)


@commands.command("lock-rule")
def lock_rule(ctx: typer.Context, rule_id: str,
              unlock_delay_days: Annotated[int, typer.Option("--unlock-delay-days", help="7-30.")]) -> None:
    """Lock a region-level rule: nobody deletes it or changes its retention until it is unlocked."""
    c: Context = ctx.obj
    _emit_rule(c, c.client.call("PUT", f"/v1/recycle-bin/rules/{rule_id}/lock",
                                {"unlock_delay_days": unlock_delay_days}))


@commands.command("unlock-rule")
def unlock_rule(ctx: typer.Context, rule_id: str) -> None:
    """Start a locked rule's unlock delay: it is unlocked when the delay ends."""
    c: Context = ctx.obj
    _emit_rule(c, c.client.call("DELETE", f"/v1/recycle-bin/rules/{rule_id}/lock"))


def _list_bin(c: Context, kind: str, ids: list[str] | None, page: int, columns: list[Column]) -> None:
    """The bin's ``kind``s (snapshot, volume): these ids, else every one, a largest ``page`` at a time."""
    params = [(f"{kind}_id", i) for i in ids or []] + ([] if ids else [("max_results", str(page))])
    body = pages(c, f"/v1/recycle-bin/{kind}s", f"{kind}s", params)
    output.emit(body if output.is_machine(c.fmt) else body[f"{kind}s"], c.fmt, columns)


@commands.command("list-snapshots-in-recycle-bin")
def list_snapshots_in_recycle_bin(ctx: typer.Context, snapshot_ids: IdsArg = None) -> None:
    """Your deleted snapshots a rule keeps in the bin, and until when."""
    _list_bin(ctx.obj, "snapshot", snapshot_ids, 1000, BIN_SNAPSHOT_COLUMNS)


@commands.command("restore-snapshot-from-recycle-bin")
def restore_snapshot_from_recycle_bin(ctx: typer.Context, snapshot_id: str) -> None:
    """Bring a snapshot back from the bin, as it was (completed, with its tags)."""
    c: Context = ctx.obj
    output.emit(c.client.call("POST", f"/v1/recycle-bin/snapshots/{snapshot_id}/restore"), c.fmt)


@commands.command("list-volumes-in-recycle-bin")
def list_volumes_in_recycle_bin(ctx: typer.Context, volume_ids: IdsArg = None) -> None:
    """Your deleted volumes a rule keeps in the bin, and until when."""
    _list_bin(ctx.obj, "volume", volume_ids, 500, BIN_VOLUME_COLUMNS)


@commands.command("restore-volume-from-recycle-bin")
def restore_volume_from_recycle_bin(ctx: typer.Context, volume_id: str) -> None:
    """Bring a volume back from the bin, as it was (available, with its data and tags)."""
    c: Context = ctx.obj
    output.emit(c.client.call("POST", f"/v1/recycle-bin/volumes/{volume_id}/restore"), c.fmt)
