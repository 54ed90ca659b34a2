"""The ``vbs`` executable: the paper's volume commands, kept word for word, plus the service commands.

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
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import quote, urlencode

import typer
from typer.models import CommandInfo

from vbs.cli import output
from vbs.cli.client import LongPoll, step_progress, wait_for, wait_operation, watch
from vbs.cli.database import db_app, warn_if_password_on_argv
from vbs.errors import InvalidParameter, VbsError
from vbs.net.endpoints import DEFAULT_CONTROLLER_PORT

# Start-up is paid on every command: this module imports only what every command needs (typer, the
# client plumbing's light parts); httpx and the rest load where a command uses them, and the services'
# modules (FastAPI, SQLAlchemy, QMP, libvirt, ...) only in the commands that run a service
# (tests/test_cli_startup.py checks it).
if TYPE_CHECKING:
    from vbs.net.api_client import ApiClient


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


class Context:
    def __init__(self, endpoint: str | None, fmt: str, ca_bundle: str | None = None, *, paginate: bool = True,
                 profile: str | None = None, region: str | None = None) -> None:
        self.paginate = paginate
        self.profile = profile
        self.region = region
        self.endpoint = endpoint
        self.fmt = fmt
        self.ca_bundle = ca_bundle
        self._client: ApiClient | None = None

    @property
    def client(self) -> "ApiClient":
        """The client of the endpoints (checked here: the service commands do not use them)."""
        if self._client is None:
            from vbs.cli import profiles
            from vbs.net import endpoints
            from vbs.net.api_client import ApiClient
            from vbs.trust import credentials
            from vbs.trust.tls import client_verify

            # --endpoint and --ca-bundle (or their variables) first, then the named profile's.
            named = profiles.load(self.profile or "default")
            region = self.region or named.region
            endpoint = self.endpoint or named.endpoint_for(region) or f"http://127.0.0.1:{DEFAULT_CONTROLLER_PORT}"
            urls = endpoints.parse(endpoint, what="--endpoint (VBS_ENDPOINT)")
            key = credentials.for_client(urls, profile=self.profile)
            https = not all(url.startswith("http://") for url in urls)
            client = ApiClient(urls, key.bearer if key else None, timeout=60,
                               verify=client_verify(self.ca_bundle or named.ca_bundle, https=https))
            if region is not None:
                served = client.call("GET", "/v1/region")["region"]
                if served != region:
                    raise InvalidParameter(f"{endpoint} serves region {served}, not {region}: give the endpoint of "
                                           f"{region} (or endpoint_{region} in the profile)", code="RegionMismatch")
            self._client = client
        return self._client

    @property
    def interactive(self) -> bool:
        return output.resolve_format(self.fmt) == "table"


@app.callback()
def _global(
    ctx: typer.Context,
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


def _tags(values: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"tag {item!r} must be KEY=VALUE")
        out[key] = value
    return out


def _pages(c: Context, path: str, collection: str, params: list[tuple[str, str]]) -> dict[str, Any]:
    """Every page of a describe, merged: the API answers at most 1,000 items a call."""
    body = c.client.call("GET", f"{path}?" + urlencode(params))
    if not c.paginate:
        return dict(body)  # --no-paginate: this page and its next token
    items = list(body[collection])
    while body.get("next_token"):
        body = c.client.call("GET", f"{path}?" + urlencode([*params, ("next_token", body["next_token"])]))
        items += body[collection]
    return {collection: items}


def _describe(c: Context, collection: str, id_param: str, resource_ids: list[str] | None,
              filters: list[str] | None, max_results: int | None, next_token: str | None,
              columns: list[output.Column]) -> None:
    """Everything that matches, or one page (and the next token) where --max-results or --next-token ask for it."""
    params = [(id_param, v) for v in resource_ids or []] + [("filter", f) for f in filters or []]
    if max_results is None and next_token is None:
        body = _pages(c, f"/v1/{collection}", collection, params + ([] if resource_ids else [("max_results", "1000")]))
    else:
        if max_results is not None:
            params.append(("max_results", str(max_results)))
        if next_token:
            params.append(("next_token", next_token))
        body = c.client.call("GET", f"/v1/{collection}?" + urlencode(params))
    if output.is_machine(c.fmt):
        output.emit(body, c.fmt)
        return
    output.emit(body[collection], c.fmt, columns)
    if body.get("next_token"):
        print(f"next token: {body['next_token']}")


def _describe_all(c: Context, collection: str, path: str, columns: list[output.Column]) -> None:
    body = _pages(c, path, collection, [("max_results", "1000")])
    if output.is_machine(c.fmt):
        output.emit(body, c.fmt)
    else:
        output.emit(body[collection], c.fmt, columns)
        if body.get("next_token"):
            print(f"next token: {body['next_token']}")


# -- volumes ---------------------------------------------------------------------------------------


@app.command("create-volume")
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
    tag: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")] = None,
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
                            "placement": placement, "tags": _tags(tag), "encrypted": encrypted}
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


@app.command("delete-volume")
def delete_volume(ctx: typer.Context, volume_id: str,
                  wait: Annotated[bool, typer.Option("--wait")] = False) -> None:
    """Delete an available volume (its snapshots stay)."""
    c: Context = ctx.obj
    vol = c.client.call("DELETE", f"/v1/volumes/{volume_id}")
    if wait:
        vol = wait_for(c.client, f"/v1/volumes/{volume_id}", busy={"deleting"}, label=f"deleting {volume_id}",
                       show=c.interactive)
    output.emit(vol, c.fmt, output.VOLUME_COLUMNS)


@app.command("describe-volumes")
def describe_volumes(
    ctx: typer.Context,
    volume_ids: Annotated[list[str] | None, typer.Argument()] = None,
    filter_: Annotated[list[str] | None, typer.Option("--filter", help="name=value, repeatable.")] = None,
    max_results: Annotated[int | None, typer.Option()] = None,
    next_token: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Describe volumes, by id or by filters (status, snapshot-id, volume-id, size, tag:KEY, tag-key …)."""
    _describe(ctx.obj, "volumes", "volume_id", volume_ids, filter_, max_results, next_token, output.VOLUME_COLUMNS)


@app.command("modify-volume")
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
    output.emit(mod, "json")
    if mod["state"] == "failed":
        raise typer.Exit(1)


@app.command("attach-volume")
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
    if wait:
        att = _wait_attachment(c, volume_id, att, "attaching")
    output.emit(att, c.fmt, output.ATTACHMENT_COLUMNS)
    if att["state"] not in ("attaching", "attached"):
        raise typer.Exit(1)


@app.command("detach-volume")
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
    if wait:
        att = _wait_attachment(c, volume_id, att, "detaching")
    output.emit(att, c.fmt, output.ATTACHMENT_COLUMNS)
    if att["state"] == "busy":
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


@app.command("describe-hosts")
def describe_hosts(
    ctx: typer.Context,
    probes: Annotated[bool, typer.Option("--probes", help="One row per host and storage node: the RTT and "
                                         "throughput the host last measured.")] = False,
) -> None:
    """Hypervisor nodes, how many VMs each reports and their RTT to each storage node."""
    c: Context = ctx.obj
    if not probes:
        _describe_all(c, "hosts", "/v1/hosts", output.HOST_COLUMNS)
        return
    hosts = _pages(c, "/v1/hosts", "hosts", [("max_results", "1000")])["hosts"]
    rows = [{"host": h["name"], **p} for h in hosts for p in h.get("probes", [])]
    output.emit(rows, c.fmt, output.PROBE_COLUMNS)


@app.command("advise")
def advise(
    ctx: typer.Context,
    volume_id: str,
    instance: Annotated[str, typer.Option(help="The instance i-… that uses the volume.")],
    io_gib: Annotated[float | None, typer.Option(help="GiB the job reads or writes (default: the volume's "
                                                 "size).")] = None,
    random_ios: Annotated[int, typer.Option(help="4 KiB random I/Os the job makes besides.")] = 0,
    memory_mib: Annotated[int, typer.Option(help="The VM's memory (what moving it copies).")] = 1024,
) -> None:
    """Remote access vs moving the VM or the volume, costed from the hosts' measured RTT probes."""
    c: Context = ctx.obj
    params = {"instance": instance, "random_ios": str(random_ios), "memory_mib": str(memory_mib)}
    if io_gib is not None:
        params["io_gib"] = str(io_gib)
    found = c.client.call("GET", f"/v1/volumes/{quote(volume_id, safe='')}/advice", params=params)
    if output.is_machine(c.fmt):
        output.emit(found, c.fmt)
        return
    m = found["model"]
    window = "one RTT only" if m["window_mib"] is None else f"window {m['window_mib']:.3f} MiB"
    print(f"model: {m['source']}, {m['protocol']}, link {m['link_mbps']:.1f} MiB/s, {window}; "
          f"copy {m['copy_mbps']:.1f} MiB/s ({m['copy_source']})")
    output.emit(found["options"], c.fmt, output.ADVICE_COLUMNS)
    for note in found["notes"]:
        print(f"note: {note}")
    print(f"recommended: {found['recommended']}")


@app.command("describe-instances")
def describe_instances(ctx: typer.Context) -> None:
    """The VMs host agents discovered, with their attached volumes."""
    _describe_all(ctx.obj, "instances", "/v1/instances", output.INSTANCE_COLUMNS)


# -- snapshots -------------------------------------------------------------------------------------


@app.command("create-snapshot")
def create_snapshot(
    ctx: typer.Context,
    volume_id: str,
    comment: Annotated[str, typer.Option()] = "",
    tag: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until completed (progress bar).")] = False,
) -> None:
    """Snapshot a volume (crash-consistent; also of an in-use volume)."""
    c: Context = ctx.obj
    _show_snapshots(c, [c.client.call("POST", "/v1/snapshots", {"volume_id": volume_id, "comment": comment,
                                                                 "tags": _tags(tag)})], wait, one=True)


def _show_snapshots(c: Context, snaps: list[dict[str, Any]], wait: bool, *, one: bool = False) -> None:
    """Print new snapshots, once completed with ``wait`` (a progress bar each); exit 1 if one failed."""
    if wait:
        snaps = [wait_for(c.client, f"/v1/snapshots/{s['snapshot_id']}", busy={"pending"},
                          label=f"snapshot {s['snapshot_id']}", show=c.interactive) for s in snaps]
    output.emit(snaps[0] if one else snaps, c.fmt, output.SNAPSHOT_COLUMNS)
    if any(s["status"] == "error" for s in snaps):
        raise typer.Exit(1)


@app.command("create-snapshots")
def create_snapshots(
    ctx: typer.Context,
    instance_id: str,
    comment: Annotated[str, typer.Option()] = "",
    tag: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")] = None,
    copy_volume_tags: Annotated[bool, typer.Option("--copy-volume-tags", help="Each snapshot gets its volume's "
                                                                               "tags too.")] = False,
    exclude: Annotated[list[str] | None, typer.Option(help="A volume id to leave out; repeatable.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until all are completed (progress bar).")] = False,
) -> None:
    """Snapshot every volume attached to an instance at one instant (crash-consistent as a set: the VM
    pauses while the storage nodes take them, milliseconds on reflink pools)."""
    c: Context = ctx.obj
    made = c.client.call("POST", "/v1/snapshot-sets", {"instance_id": instance_id, "comment": comment,
                                                       "tags": _tags(tag), "copy_tags_from_volume": copy_volume_tags,
                                                       "exclude_volume_ids": exclude or []})["snapshots"]
    _show_snapshots(c, made, wait)


@app.command("copy-snapshot")
def copy_snapshot(
    ctx: typer.Context,
    snapshot_id: str,
    comment: Annotated[str, typer.Option()] = "",
    tag: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")] = None,
    encrypted: Annotated[bool, typer.Option("--encrypted", help="Encrypt the copy (a copy of an encrypted "
                                                                "snapshot is encrypted anyway).")] = False,
    kms_key_id: Annotated[str | None, typer.Option(help="Another KMS key id: the copy is re-encrypted under a new "
                                                        "data key.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until completed (progress bar).")] = False,
) -> None:
    """Copy a snapshot (yours, or one shared with you) into a new snapshot of yours; with --encrypted (or
    another --kms-key-id) re-encrypted under a new key."""
    c: Context = ctx.obj
    body: dict[str, Any] = {"source_snapshot_id": snapshot_id, "comment": comment, "tags": _tags(tag),
                            "encrypted": encrypted}
    if kms_key_id is not None:
        body["kms_key_id"] = kms_key_id
    _show_snapshots(c, [c.client.call("POST", "/v1/snapshot-copies", body)], wait, one=True)


@app.command("share-snapshot")
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


@app.command("delete-snapshot")
def delete_snapshot(ctx: typer.Context, snapshot_id: str) -> None:
    """Delete a snapshot (volumes made from it stay)."""
    c: Context = ctx.obj
    output.emit(c.client.call("DELETE", f"/v1/snapshots/{snapshot_id}"), c.fmt, output.SNAPSHOT_COLUMNS)


@app.command("describe-snapshots")
def describe_snapshots(
    ctx: typer.Context,
    snapshot_ids: Annotated[list[str] | None, typer.Argument()] = None,
    filter_: Annotated[list[str] | None, typer.Option("--filter", help="name=value, repeatable.")] = None,
    max_results: Annotated[int | None, typer.Option()] = None,
    next_token: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Describe snapshots, by id or by filters (status, volume-id, tag:KEY …)."""
    _describe(ctx.obj, "snapshots", "snapshot_id", snapshot_ids, filter_, max_results, next_token,
              output.SNAPSHOT_COLUMNS)


app.command("describe-snapshot", help="Alias of describe-snapshots (the paper's name).")(describe_snapshots)


# -- tags, nodes -----------------------------------------------------------------------------------


@app.command("create-tags")
def create_tags(ctx: typer.Context, resource_ids: list[str],
                tag: Annotated[list[str], typer.Option(help="KEY=VALUE, repeatable.")]) -> None:
    """Add or overwrite tags on volumes and snapshots."""
    c: Context = ctx.obj
    # Setting the same tags twice changes nothing: safe to repeat at another endpoint.
    output.emit(c.client.call("POST", "/v1/tags", {"resource_ids": resource_ids, "tags": _tags(tag)},
                              idempotent=True), "json")


@app.command("delete-tags")
def delete_tags(ctx: typer.Context, resource_ids: list[str],
                key: Annotated[list[str] | None, typer.Option(help="Tag key, repeatable; none = all.")] = None) -> None:
    """Remove tags from volumes and snapshots."""
    c: Context = ctx.obj
    output.emit(c.client.call("POST", "/v1/tags/delete", {"resource_ids": resource_ids, "keys": key or []},
                              idempotent=True), "json")


@app.command("describe-storage-nodes")
def describe_storage_nodes(ctx: typer.Context) -> None:
    """Storage nodes, their pools, free space and clone method (reflink or copy)."""
    _describe_all(ctx.obj, "storage_nodes", "/v1/storage-nodes", output.NODE_COLUMNS)


@app.command("describe-controllers")
def describe_controllers(ctx: typer.Context) -> None:
    """Controllers on this database: id, URL, last renewal, unfinished operations they hold, and the
    singleton loops (reconciler, housekeeping) they run."""
    _describe_all(ctx.obj, "controllers", "/v1/controllers", output.CONTROLLER_COLUMNS)


@app.command("drain-storage-node")
def drain_storage_node(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The storage node's name.")],
    undo: Annotated[bool, typer.Option("--undo", help="Let it take new volumes again.")] = False,
) -> None:
    """Stop placing new volumes on a storage node (admin); clones of its snapshots still go there.
    Prints the volumes and snapshots that still live on it."""
    c: Context = ctx.obj
    found = c.client.call("POST", f"/v1/storage-nodes/{quote(name, safe='')}/drain", {"undo": undo})
    if output.is_machine(c.fmt):
        output.emit(found, "json")
        return
    node = found["storage_node"]
    print(f"storage node {node['name']} ({node['state']}) is {'drained' if node['drained'] else 'not drained'}: "
          f"{len(found['volumes'])} volume(s) and {len(found['snapshots'])} snapshot(s) live on it")
    if found["volumes"]:
        output.emit(found["volumes"], c.fmt, output.RESIDENT_COLUMNS, title="volumes")
    if found["snapshots"]:
        output.emit(found["snapshots"], c.fmt, output.RESIDENT_COLUMNS, title="snapshots")


@app.command("migrate-volume")
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
    if wait:
        op = wait_operation(c.client, move["operation_id"], label=f"moving {volume_id}", show=c.interactive)
    else:
        op = c.client.call("GET", f"/v1/operations/{move['operation_id']}")
    output.emit({**move, "status": op["status"], "error": op["error"]}, "json")
    if op["status"] in ("rolled-back", "failed"):
        raise typer.Exit(1)


@app.command("migrate-instance")
def migrate_instance(
    ctx: typer.Context,
    instance_id: str,
    host: Annotated[str, typer.Option(help="The host where the orchestrator started the destination VM "
                                           "(same VM id, QEMU -incoming defer).")],
    timeout: Annotated[float, typer.Option(help="Seconds the migration itself may take.")] = 600.0,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the guest runs on the new host.")] = False,
) -> None:
    """Live-migrate an instance to another host with its VBS disks (admin): each volume is exported to the
    new host too, plugged into the waiting VM, QEMU migrates the guest, then the old host's access goes."""
    c: Context = ctx.obj
    move = c.client.call("POST", f"/v1/instances/{instance_id}/migrations", {"host": host, "timeout_s": timeout})
    if wait:
        op = wait_operation(c.client, move["operation_id"], label=f"migrating {instance_id}", show=c.interactive)
    else:
        op = c.client.call("GET", f"/v1/operations/{move['operation_id']}")
    output.emit({**move, "status": op["status"], "error": op["error"]}, "json")
    if op["status"] in ("rolled-back", "failed"):
        raise typer.Exit(1)


@app.command("describe-availability-zones")
def describe_availability_zones(ctx: typer.Context) -> None:
    """The zones of the storage nodes: available while one of their nodes is up."""
    c: Context = ctx.obj
    body = c.client.call("GET", "/v1/availability-zones")
    output.emit(body if output.is_machine(c.fmt) else body["availability_zones"], c.fmt,
                output.ZONE_COLUMNS)


@app.command("check")
def check(
    ctx: typer.Context,
    repair: Annotated[bool, typer.Option("--repair", help="Repair what drifted (orphans after their grace).")] = False,
    now: Annotated[bool, typer.Option("--now", help="With --repair: remove orphans without the grace period.")]
    = False,
) -> None:
    """Compare what the agents really have with the DB: orphans, missing files, exports and disks."""
    c: Context = ctx.obj
    report = (c.client.call("POST", f"/v1/admin/reconcile?now={str(now).lower()}") if repair
              else c.client.call("GET", "/v1/admin/check"))
    if output.is_machine(c.fmt):
        output.emit(report, "json")
    else:
        print(f"checked {report['storage_nodes']} storage node(s) and {report['hosts']} host(s): "
              + ("everything agrees" if report["clean"] else f"{len(report['findings'])} finding(s)"))
        if report["findings"]:
            output.emit(report["findings"], c.fmt, output.FINDING_COLUMNS)
        _emit_pool_details(report.get("pools", []), c.fmt)
    if not report["clean"] and not repair:
        raise typer.Exit(1)


def _emit_pool_details(pools: list[dict[str, Any]], fmt: str) -> None:
    """``vbs check``'s tables of what pools keep besides volumes: trash, clone chains, flattens."""
    for key, columns, title in (("trash", output.TRASH_COLUMNS, "trash (images of deleted volumes)"),
                                ("chains", output.CHAIN_COLUMNS, "clone chains deeper than 1"),
                                ("flattens", output.FLATTEN_COLUMNS, "flattens")):
        rows = [{"node": p["node"], "pool": p["pool"], **item} for p in pools for item in p[key]]
        if rows:
            output.emit(rows, fmt, columns, title=title)


@app.command("create-key")
def create_key(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="The tenant whose volumes and snapshots the key sees.")],
    role: Annotated[str, typer.Option(help="admin | user | metrics (reads /metrics only)")] = "user",
) -> None:
    """Make an access key (admin only); its secret is shown this once."""
    c: Context = ctx.obj
    key = c.client.call("POST", "/v1/keys", {"tenant": tenant, "role": role})
    if output.is_machine(c.fmt):
        output.emit({"access_key_id": key["access_key_id"], "secret_access_key": key["secret_access_key"]}, "json")
    else:
        print(f"access key id:     {key['access_key_id']}\nsecret access key: {key['secret_access_key']}\n"
              f"tenant: {key['tenant']}, role: {key['role']} (the secret is not shown again)")


@app.command("delete-key")
def delete_key(ctx: typer.Context, access_key_id: str) -> None:
    """Delete an access key made by create-key (admin only); requests signed with it are refused at once."""
    c: Context = ctx.obj
    output.emit(c.client.call("DELETE", f"/v1/keys/{access_key_id}"), "json")


@app.command("describe-keys")
def describe_keys(ctx: typer.Context) -> None:
    """Access keys, their tenants and roles, never their secrets (admin only)."""
    c: Context = ctx.obj
    body = c.client.call("GET", "/v1/keys")
    output.emit(body if output.is_machine(c.fmt) else body["keys"], c.fmt, output.KEY_COLUMNS)


@app.command("describe-operation")
def describe_operation(ctx: typer.Context, operation_id: str) -> None:
    """One workflow's steps and their states."""
    c: Context = ctx.obj
    output.emit(c.client.call("GET", f"/v1/operations/{operation_id}"), "json")


# -- services --------------------------------------------------------------------------------------


# Options every service command takes, declared once.
ConfigOpt = Annotated[Path | None, typer.Option(help="vbs.toml")]
HostOpt = Annotated[str | None, typer.Option(help="Address to listen on.")]
PortOpt = Annotated[int | None, typer.Option(help="Port to listen on.")]
NodeNameOpt = Annotated[str | None, typer.Option(help="This node's name, unique among nodes of its kind.")]
ControllerUrlsOpt = Annotated[list[str] | None, typer.Option(
    help="A controller's URL; repeat it (or separate URLs by commas) for each controller.")]
TlsCertOpt = Annotated[Path | None, typer.Option(help="This service's certificate (PEM).")]
TlsKeyOpt = Annotated[Path | None, typer.Option(help="Its private key (PEM, 0600).")]
TlsCaOpt = Annotated[Path | None, typer.Option(help="CA that peers' certificates chain to.")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="Run without credentials/TLS (says so).")]
TokenFileOpt = Annotated[Path | None, typer.Option(help="File with this node's token (0600).")]
LogJsonOpt = Annotated[bool, typer.Option("--log-json")]


@app.command("controller")
def controller(
    config: ConfigOpt = None, host: HostOpt = None, port: PortOpt = None,
    data_dir: Annotated[Path | None, typer.Option()] = None,
    database_url: Annotated[str | None, typer.Option(
        help="postgresql+psycopg://… (default: SQLite in the data dir); a password belongs in the file.")] = None,
    database_url_file: Annotated[Path | None, typer.Option(help="A 0600 file holding the database URL.")] = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None, insecure: InsecureOpt = False,
    overcommit_ratio: Annotated[float | None, typer.Option(help="A pool promises up to capacity x this.")] = None,
    quota_volumes: Annotated[int | None, typer.Option(help="Volumes per tenant.")] = None,
    quota_gib: Annotated[int | None, typer.Option(help="GiB of volumes per tenant.")] = None,
    quota_snapshots: Annotated[int | None, typer.Option(help="Snapshots per tenant.")] = None,
    controller_id: Annotated[str | None, typer.Option(
        help="This controller's id among several on one database (default: <hostname>-<port>).")] = None,
    advertise_url: Annotated[str | None, typer.Option(
        help="The URL others reach this controller at (vbs describe-controllers).")] = None,
    log_json: LogJsonOpt = False,
) -> None:
    """Run the controller (REST API, metadata DB, workflows)."""
    from vbs import config as cfgmod
    from vbs.controller.app import serve
    from vbs.system import logs

    logs.setup("controller", json_lines=log_json)
    warn_if_password_on_argv(database_url)
    cfg = cfgmod.load(cfgmod.ControllerConfig, "controller", config_file=config, overrides={
        "host": host, "port": port, "data_dir": data_dir, "database_url": database_url,
        "database_url_file": database_url_file,
        "overcommit_ratio": overcommit_ratio, "quota_volumes": quota_volumes, "quota_gib": quota_gib,
        "quota_snapshots": quota_snapshots, "controller_id": controller_id, "advertise_url": advertise_url,
        **_security(tls_cert, tls_key, tls_ca, insecure)})
    serve(cfg)


@app.command("storage-agent")
def storage_agent(
    config: ConfigOpt = None, host: HostOpt = None, port: PortOpt = None,
    node_name: NodeNameOpt = None, controller_url: ControllerUrlsOpt = None,
    pool_path: Annotated[Path | None, typer.Option(help="The directory of the one pool 'default'.")] = None,
    pool: Annotated[list[str] | None, typer.Option(
        "--pool", help="NAME=PATH: a pool this node serves (repeat for several; replaces --pool-path).")] = None,
    availability_zone: Annotated[str | None, typer.Option(
        help="This node's zone (default: the controller's zone, e.g. us-east-1a).")] = None,
    clone_method: Annotated[str | None, typer.Option(help="reflink | copy (default: detect)")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Export daemons' sockets and state.")] = None,
    backend: Annotated[str | None, typer.Option(help="Backend driver by name (default: file).")] = None,
    export: Annotated[str | None, typer.Option(help="Export driver by name: nbd | iscsi.")] = None,
    nbd_port: Annotated[int | None, typer.Option()] = None,
    nbd_socket_dir: Annotated[Path | None, typer.Option(
        help="Serve NBD on <dir>/nbd.sock (a 0700 directory) instead of TCP: hypervisors on this machine.")] = None,
    iscsi_port: Annotated[int | None, typer.Option()] = None,
    iscsi_control: Annotated[int | None, typer.Option(help="tgtd control number (-C).")] = None,
    ceph_conf: Annotated[Path | None, typer.Option(
        help="rbd backend: the cluster's ceph.conf (it names the user's keyring).")] = None,
    ceph_user: Annotated[str | None, typer.Option(help="rbd backend: the cephx user (default: admin).")] = None,
    rbd_pool: Annotated[str | None, typer.Option(help="rbd backend: the Ceph pool (default: rbd).")] = None,
    rbd_max_clone_depth: Annotated[int | None, typer.Option(
        help="rbd backend: flatten clones deeper than this in the background (default: 5).")] = None,
    rbd_max_flattens: Annotated[int | None, typer.Option(
        help="rbd backend: at most this many flattens at once (default: 2).")] = None,
    rbd_max_snapshots_per_volume: Annotated[int | None, typer.Option(
        help="rbd backend: the most snapshots a volume may have (default and most: 450).")] = None,
    backend_profile: Annotated[str | None, typer.Option(
        help="command backend: the profile, by name (qemu-img, lvm, or one in --backend-profile-dir) or as a "
             "path to a TOML file.")] = None,
    backend_profile_dir: Annotated[list[Path] | None, typer.Option(
        "--backend-profile-dir", help="command backend: where profiles are looked up first (default: "
                                      "/etc/vbs/profiles); repeatable.")] = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None, insecure: InsecureOpt = False,
    agent_token_file: TokenFileOpt = None, log_json: LogJsonOpt = False,
) -> None:
    """Run a storage agent (backends and exports of one volume server)."""
    from vbs import config as cfgmod
    from vbs.storage.service import serve
    from vbs.system import logs

    logs.setup("storage-agent", json_lines=log_json)
    cfg = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", config_file=config, overrides={
        "host": host, "port": port, "node_name": node_name, "controller_url": controller_url,
        "pool_path": pool_path, "pools": pool, "availability_zone": availability_zone,
        "clone_method": clone_method, "state_dir": state_dir, "backend": backend,
        "export": export, "nbd_port": nbd_port, "nbd_socket_dir": nbd_socket_dir,
        "iscsi_port": iscsi_port, "iscsi_control": iscsi_control,
        "ceph_conf": ceph_conf, "ceph_user": ceph_user, "rbd_pool": rbd_pool,
        "rbd_max_clone_depth": rbd_max_clone_depth, "rbd_max_flattens": rbd_max_flattens,
        "rbd_max_snapshots_per_volume": rbd_max_snapshots_per_volume,
        "profile": backend_profile, "profile_dirs": backend_profile_dir or None,
        "agent_token_file": agent_token_file, **_security(tls_cert, tls_key, tls_ca, insecure)})
    serve(cfg)


LibvirtUriOpt = Annotated[str | None, typer.Option(
    help="libvirt hypervisor driver: the libvirt connection URI (default: qemu:///system).")]
ProfileOpt = Annotated[str | None, typer.Option(
    help="command hypervisor driver: the profile, by name (virsh-path, virsh, xen, proxmox, qemu-monitor, or "
         "one in --profile-dir) or as a path to a TOML file.")]
ProfileDirOpt = Annotated[list[Path] | None, typer.Option(
    "--profile-dir", help="command hypervisor driver: where profiles are looked up first (default: "
                          "/etc/vbs/profiles); repeatable.")]


@app.command("host-agent")
def host_agent(
    config: ConfigOpt = None, host: HostOpt = None, port: PortOpt = None,
    node_name: NodeNameOpt = None, controller_url: ControllerUrlsOpt = None,
    vm_dir: Annotated[Path | None, typer.Option(help="Directory of <vm>.qmp sockets.")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="This agent's own state (0700; fences).")] = None,
    address: Annotated[str | None, typer.Option(help="This node's address, for export ACLs.")] = None,
    hypervisor: Annotated[str | None, typer.Option(help="Hypervisor driver by name (default: qemu).")] = None,
    libvirt_uri: LibvirtUriOpt = None,
    libvirt_persist: Annotated[bool, typer.Option(
        "--libvirt-persist", help="libvirt: an attach also goes into a persistent domain's configuration.")] = False,
    profile: ProfileOpt = None, profile_dir: ProfileDirOpt = None,
    local_pool: Annotated[list[str] | None, typer.Option(
        help="A local pool NAME=PATH on this node's own disks (semi-shared storage; repeatable).")] = None,
    local_backend: Annotated[str | None, typer.Option(help="Backend driver of the local pools (default: file).")]
    = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None, insecure: InsecureOpt = False,
    agent_token_file: TokenFileOpt = None, log_json: LogJsonOpt = False,
) -> None:
    """Run a host agent (hot-plug into the VMs of one hypervisor node)."""
    from vbs import config as cfgmod
    from vbs.host.service import serve
    from vbs.system import logs

    logs.setup("host-agent", json_lines=log_json)
    cfg = cfgmod.load(cfgmod.HostAgentConfig, "host_agent", config_file=config, overrides={
        "host": host, "port": port, "node_name": node_name, "controller_url": controller_url, "vm_dir": vm_dir,
        "state_dir": state_dir,
        "address": address, "hypervisor": hypervisor, "agent_token_file": agent_token_file,
        "libvirt_uri": libvirt_uri, "libvirt_persist": libvirt_persist or None,
        "profile": profile, "profile_dirs": profile_dir or None,
        "local_pools": local_pool or None, "local_backend": local_backend,
        **_security(tls_cert, tls_key, tls_ca, insecure)})
    serve(cfg)


@app.command("up")
def up(
    data_dir: Annotated[Path, typer.Option(help="DB, pool and state of the embedded install.")] = Path("./var"),
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = DEFAULT_CONTROLLER_PORT,
    clone_method: Annotated[str | None, typer.Option(help="reflink | copy (default: detect)")] = None,
    export: Annotated[str, typer.Option(help="nbd | iscsi")] = "nbd",
    tls: Annotated[bool, typer.Option("--tls", help="HTTPS everywhere, with a private CA in the data dir.")] = False,
    overcommit_ratio: Annotated[float | None, typer.Option(help="Controller: a pool promises up to capacity x this.")]
    = None,
    quota_volumes: Annotated[int | None, typer.Option(help="Controller: volumes per tenant.")] = None,
    quota_gib: Annotated[int | None, typer.Option(help="Controller: GiB of volumes per tenant.")] = None,
    quota_snapshots: Annotated[int | None, typer.Option(help="Controller: snapshots per tenant.")] = None,
    enforce_type_limits: Annotated[bool, typer.Option(
        "--enforce-type-limits", help="Controller: throttle volumes without limits of their own to their type's "
                                      "nominal ones (gp3: 3,000 IOPS, 125 MiB/s).")] = False,
    database_url: Annotated[str | None, typer.Option(
        help="Controller: metadata in this PostgreSQL (postgresql+psycopg://…), upgraded by `vbs db upgrade`.")]
    = None,
    database_url_file: Annotated[Path | None, typer.Option(help="A 0600 file holding that URL.")] = None,
    postgres: Annotated[bool, typer.Option(
        "--postgres", help="Metadata in a PostgreSQL cluster of the data dir's own, started and stopped with it.")]
    = False,
    controllers: Annotated[int, typer.Option(
        help="Controllers (1-8), on --port and the ports after it; more than one needs PostgreSQL.")] = 1,
    storage_nodes: Annotated[int, typer.Option(
        help="Storage agents (1-16), each with its own pool (with --backend rbd: all on the one Ceph pool).")] = 1,
    backend: Annotated[str, typer.Option(
        help="file | rbd (Ceph: the data dir's own single-node cluster, or --ceph-conf's) | command "
             "(with --backend-profile).")] = "file",
    backend_profile: Annotated[str | None, typer.Option(
        help="command backend: the profile (qemu-img, or a path to a TOML file).")] = None,
    ceph_conf: Annotated[Path | None, typer.Option(help="rbd: an existing cluster's ceph.conf.")] = None,
    ceph_user: Annotated[str, typer.Option(help="rbd: the cephx user (with --ceph-conf).")] = "admin",
    rbd_pool: Annotated[str, typer.Option(help="rbd: the Ceph pool of the volumes.")] = "vbs",
    hypervisor: Annotated[str, typer.Option(
        help="The host agent's hypervisor driver: qemu | libvirt | command.")] = "qemu",
    libvirt_uri: LibvirtUriOpt = None,
    profile: ProfileOpt = None, profile_dir: ProfileDirOpt = None,
    local_pool: Annotated[list[str] | None, typer.Option(
        help="The host's local pool NAME=PATH, for local volumes (semi-shared storage; repeatable).")] = None,
    log_json: LogJsonOpt = False,
) -> None:
    """Run the embedded default: controller, storage agent and host agent on this machine, until Ctrl-C;
    or a small cluster of them (--controllers, --storage-nodes)."""
    from vbs import drivers
    from vbs.cli.up import RbdChoice, Shape, run_embedded
    from vbs.config import CEPH_USER_RE, RBD_POOL_RE

    shape = Shape(controllers, storage_nodes)
    if backend not in ("file", "rbd", "command"):
        raise typer.BadParameter("--backend must be file, rbd or command")
    storage_flags = _backend_profile_flags(backend, backend_profile)
    if backend == "file" and (ceph_conf is not None or ceph_user != "admin" or rbd_pool != "vbs"):
        raise typer.BadParameter("--ceph-conf, --ceph-user and --rbd-pool go with --backend rbd")
    if ceph_conf is None and ceph_user != "admin":
        raise typer.BadParameter("--ceph-user goes with --ceph-conf (the data dir's own cluster uses admin)")
    if not re.fullmatch(CEPH_USER_RE, ceph_user) or not re.fullmatch(RBD_POOL_RE, rbd_pool):
        raise typer.BadParameter("invalid --ceph-user or --rbd-pool")
    if ceph_conf is not None and not ceph_conf.is_file():
        raise typer.BadParameter(f"--ceph-conf {ceph_conf} is not a file")
    rbd = RbdChoice(ceph_conf.resolve() if ceph_conf else None, ceph_user, rbd_pool) if backend == "rbd" else None
    if export not in drivers.available("export"):
        raise typer.BadParameter(f"--export must be one of {', '.join(drivers.available('export'))}")
    if hypervisor not in drivers.available("hypervisor"):
        raise typer.BadParameter(f"--hypervisor must be one of {', '.join(drivers.available('hypervisor'))}")
    host_agent_flags = ("--hypervisor", hypervisor, *(("--libvirt-uri", libvirt_uri) if libvirt_uri else ()),
                        *_profile_flags(hypervisor, profile, profile_dir or []),
                        *_local_pool_flags(local_pool or []))
    limits = {"overcommit_ratio": overcommit_ratio, "quota_volumes": quota_volumes, "quota_gib": quota_gib,
              "quota_snapshots": quota_snapshots}
    controller_env = {f"VBS_CONTROLLER_{k.upper()}": str(v) for k, v in limits.items() if v is not None}
    if enforce_type_limits:
        controller_env["VBS_CONTROLLER_ENFORCE_TYPE_LIMITS"] = "true"
    if sum((database_url is not None, database_url_file is not None, postgres)) > 1:
        raise typer.BadParameter("give one of --database-url, --database-url-file and --postgres")
    warn_if_password_on_argv(database_url)
    if database_url_file is not None:
        database_url = database_url_file.read_text().strip() or None
    raise typer.Exit(run_embedded(data_dir, host, port, shape=shape,
                                  clone_method=clone_method, export=export, log_json=log_json, tls=tls,
                                  controller_env=controller_env, database_url=database_url, postgres=postgres,
                                  rbd=rbd, host_agent_flags=host_agent_flags, storage_flags=storage_flags))


def _backend_profile_flags(backend: str, profile: str | None) -> tuple[str, ...]:
    """The storage agents' flags of the command backend, its profile checked now."""
    if backend != "command":
        if profile is not None:
            raise typer.BadParameter("--backend-profile goes with --backend command")
        return ()
    if profile is None:
        raise typer.BadParameter("--backend command needs --backend-profile NAME or PATH")
    from vbs.errors import InvalidParameter
    from vbs.profiles import DEFAULT_PROFILE_DIR, load_profile
    from vbs.storage.backends.command import BACKEND_PROFILES

    try:
        load_profile(BACKEND_PROFILES, profile, [DEFAULT_PROFILE_DIR])
    except InvalidParameter as exc:
        raise typer.BadParameter(exc.message) from exc
    path = str(Path(profile).resolve()) if "/" in profile or profile.endswith(".toml") else profile
    return ("--backend", "command", "--backend-profile", path)


def _profile_flags(hypervisor: str, profile: str | None, dirs: list[Path]) -> tuple[str, ...]:
    """The host agent's profile flags, the profile checked now: one that fails stops ``vbs up``
    before anything starts, with the file, line and key or placeholder at fault."""
    if hypervisor != "command":
        if profile is not None or dirs:
            raise typer.BadParameter("--profile and --profile-dir go with --hypervisor command")
        return ()
    if profile is None:
        raise typer.BadParameter("--hypervisor command needs --profile NAME or PATH")
    from vbs.errors import InvalidParameter
    from vbs.host.hypervisors.command import HYPERVISOR_PROFILES
    from vbs.profiles import DEFAULT_PROFILE_DIR, load_profile

    resolved = [d.resolve() for d in dirs]
    try:
        load_profile(HYPERVISOR_PROFILES, profile, resolved or [DEFAULT_PROFILE_DIR])
    except InvalidParameter as exc:
        raise typer.BadParameter(exc.message) from exc
    path = str(Path(profile).resolve()) if "/" in profile or profile.endswith(".toml") else profile
    return ("--profile", path, *(flag for d in resolved for flag in ("--profile-dir", str(d))))


def _security(tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, insecure: bool) -> dict[str, Any]:
    return {"tls_cert": tls_cert, "tls_key": tls_key, "tls_ca": tls_ca, "insecure": insecure or None}


NodeKindOpt = Annotated[str, typer.Option("--kind", help="storage | host")]


@app.command("node-token")
def node_token(
    name: Annotated[str, typer.Argument(help="The node's name (its --node-name).")],
    kind: NodeKindOpt = "host",
    data_dir: Annotated[Path, typer.Option(help="The controller's data dir.")] = Path("./var"),
) -> None:
    """Print a node's token (run where the controller's data dir is); give it to that agent only."""
    from vbs.trust.node_credentials import NodeKeyring

    print(NodeKeyring.for_data_dir(data_dir).ensure().token(kind, name))


@app.command("issue-cert")
def issue_cert(
    name: Annotated[str, typer.Argument(help="The node's name (its --node-name): the certificate's CN.")],
    host: Annotated[list[str], typer.Option("--host", help="An address or DNS name the node serves on and "
                                                          "reports (repeat).")],
    data_dir: Annotated[Path, typer.Option(help="The data dir that holds the install's CA.")] = Path("./var"),
    out_dir: Annotated[Path | None, typer.Option(help="Where to write NAME.pem and NAME-key.pem.")] = None,
) -> None:
    """Issue a node's certificate from the install's CA (run where the CA is; made on first use). The node
    serves with it, presents it to the controller, and may report only the addresses it names."""
    from vbs.trust.fail_closed import harden
    from vbs.trust.pki import CertificateAuthority

    harden(data_dir)
    ca = CertificateAuthority.in_data_dir(data_dir)
    directory = out_dir or data_dir / "tls"
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    if cert.exists() or key.exists():
        raise InvalidParameter(f"{cert} or {key} exists already: remove them to issue a new certificate")
    files = ca.issue(name, host, cert, key)
    print(f"certificate {files.cert}\nkey         {files.key} (0600)\nCA          {files.ca}\n"
          f"run the node with --tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")


@app.command("rotate-keys")
def rotate_keys(
    ctx: typer.Context,
    node: Annotated[str | None, typer.Option(help="Rotate this node's token.")] = None,
    access_key: Annotated[str | None, typer.Option(help="Make a successor of this access key (admin).")] = None,
    master_key: Annotated[bool, typer.Option("--master-key", help="Re-seal every access key's secret and every "
                                                                  "volume data key under a new master key.")] = False,
    kind: NodeKindOpt = "host",
    data_dir: Annotated[Path, typer.Option(help="The controller's data dir.")] = Path("./var"),
    database_url: Annotated[str | None, typer.Option(help="The controller's database, if not in the data dir.")] = None,
    write_to: Annotated[Path | None, typer.Option(help="Write the new node token to this file (0600).")] = None,
    revoke: Annotated[bool, typer.Option("--revoke", help="Invalidate the node's tokens at once.")] = False,
) -> None:
    """New credentials without downtime: a node's token (the old one is accepted until the node uses the
    new one), an access key's successor (the old key works until `vbs delete-key`), or the master key."""
    chosen = [name for name, given in (("--node", node), ("--access-key", access_key), ("--master-key", master_key))
              if given]
    if len(chosen) != 1:
        raise InvalidParameter("say what to rotate: one of --node NAME, --access-key ID, --master-key")
    if access_key is not None:
        _rotate_access_key(ctx.obj, access_key)
    elif master_key:
        _rotate_master_key(data_dir, database_url)
    elif node is not None:
        _rotate_node_token(node, kind, data_dir, write_to, revoke)


def _rotate_access_key(c: Context, access_key_id: str) -> None:
    key = c.client.call("POST", f"/v1/keys/{access_key_id}/rotate")
    if output.is_machine(c.fmt):
        output.emit({"access_key_id": key["access_key_id"], "secret_access_key": key["secret_access_key"],
                     "replaces": access_key_id}, "json")
    else:
        print(f"access key id:     {key['access_key_id']}\nsecret access key: {key['secret_access_key']}\n"
              f"tenant: {key['tenant']}, role: {key['role']} (the secret is not shown again)\n"
              f"{access_key_id} keeps working: switch the clients over, then `vbs delete-key {access_key_id}`")


def _rotate_master_key(data_dir: Path, database_url: str | None) -> None:
    from vbs import config as cfgmod
    from vbs.controller.app import database_for
    from vbs.controller.auth.keys import MasterKey

    cfg = cfgmod.load(cfgmod.ControllerConfig, "controller",
                      overrides={"data_dir": data_dir, "database_url": database_url})
    db = database_for(cfg)
    try:
        count = MasterKey(cfg.master_key_file or cfg.data_dir / "master.key").rotate(db)
    finally:
        db.dispose()
    print(f"{count} secrets (access keys, volume data keys) re-sealed under a new master key; a running controller "
          "reads it at once")


def _rotate_node_token(node: str, kind: str, data_dir: Path, write_to: Path | None, revoke: bool) -> None:
    from vbs.system.files import write_private
    from vbs.trust.node_credentials import NodeKeyring

    keyring = NodeKeyring.for_data_dir(data_dir).ensure()
    if revoke:
        keyring.revoke(kind, node)
        print(f"every token of {kind} node {node} is revoked; `vbs node-token {node} --kind {kind}` prints its new one")
        return
    token = keyring.rotate(kind, node)
    if write_to is not None:
        write_private(write_to, token + "\n")
        print(f"new token of {kind} node {node} written to {write_to}; the old one is accepted until the node uses it")
    else:
        print(token)


# Options of the whole CLI (its callback): with a value, and flags.
_GLOBAL_VALUED = ("--endpoint", "--output", "-o", "--ca-bundle", "--query", "--columns", "--profile", "--region")
_GLOBAL_FLAGS = ("--no-paginate",)
def _local_pool_flags(specs: list[str]) -> tuple[str, ...]:
    """``vbs up --local-pool`` as its host agent takes it (each NAME=PATH checked here first)."""
    from vbs.config import PoolConfig

    flags: list[str] = []
    for spec in specs:
        try:
            pool = PoolConfig.parse(spec)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        flags += ["--local-pool", f"{pool.name}={pool.path.resolve()}"]
    return tuple(flags)


# Commands that run a service: their options are their own (host-agent has a --profile of its own).
_SERVICES = {"up", "controller", "storage-agent", "host-agent"}


def _command_index(argv: list[str]) -> int:
    """Where the command is: after the options before it (``len(argv)`` when there is none)."""
    pos = 0
    while pos < len(argv) and argv[pos].startswith("-"):
        pos += 2 if argv[pos] in _GLOBAL_VALUED else 1
    return pos


def _only_global_options(head: list[str]) -> bool:
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


def command_name(command: CommandInfo) -> str:
    """What a command is called on the line: its given name, else Typer's from its function's."""
    return command.name or typer.main.get_command_name(getattr(command.callback, "__name__", ""))


def app_for(argv: list[str]) -> typer.Typer:
    """The app that runs ``argv``: the global options and the one command the line names, or the whole
    app where it names none, a misspelt one, or asks before it for something else (``vbs --help
    describe-volumes``). Typer builds the click form of every command it holds from its signature,
    on every run: one command costs a fraction of all of them."""
    pos = _command_index(argv)
    if (pos >= len(argv) or _asks_help(argv[:pos])) and not any(k.endswith("_COMPLETE") for k in os.environ):
        return _listing()  # no command runs: the root help, a usage error, or the global options alone
    if pos >= len(argv) or not _only_global_options(argv[:pos]):
        return app
    commands = [c for c in app.registered_commands if command_name(c) == argv[pos]]
    groups = [g for g in app.registered_groups if g.name == argv[pos]]
    if not commands and not groups:
        return app
    one = copy.copy(app)
    one.registered_commands, one.registered_groups = commands, groups
    return one


def _asks_help(head: list[str]) -> bool:
    """``--help`` is one of the options before the command (not the value of one: ``--query --help``)."""
    i = 0
    while i < len(head):
        if head[i] == "--help":
            return True
        i += 2 if head[i] in _GLOBAL_VALUED else 1
    return False


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


def hoist_global_options(argv: list[str]) -> list[str]:
    """Global options anywhere on the line, as the AWS CLI takes them: those after the command are
    moved before it (``vbs describe-volumes --output json`` is ``vbs --output json describe-volumes``).
    Nothing after ``--`` moves; a service command's line is left as it is."""
    pos = _command_index(argv)
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
        hint = _HINTS.get(exc.code) or _HINTS.get(exc.code.split(".")[-1], "")
        print(f"error: {exc.code}: {exc.message}{f' (hint: {hint})' if hint else ''}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


# What to try next, by error code (the message says what is wrong).
_HINTS = {
    "NotFound": "the describe command of that kind lists what exists",
    "AuthFailure": "check VBS_ACCESS_KEY_ID/VBS_SECRET_ACCESS_KEY, --profile, or the key vbs up printed",
    "UnauthorizedOperation": "an admin key can; vbs create-key makes one",
    "AgentUnavailable": "is the controller running? (vbs up starts one; --endpoint points elsewhere)",
    "IncorrectState": "vbs describe-volumes shows its status and attachments",
    "VolumeInUse": "detach it first: vbs detach-volume",
}
