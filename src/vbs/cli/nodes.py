"""Commands about where things run: hosts and their probes, instances (and their live migration), storage
nodes, controllers, availability zones, and the advice between moving and remote access."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
from typing import Annotated
from urllib.parse import quote

import typer

from vbs.cli import output
from vbs.cli.context import Context, describe_all, emit_operation, pages

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()


@commands.command("describe-hosts")
def describe_hosts(
    ctx: typer.Context,
    probes: Annotated[bool, typer.Option("--probes", help="One row per host and storage node: the RTT and "
                                         "throughput the host last measured.")] = False,
) -> None:
    """Hypervisor nodes, how many VMs each reports and their RTT to each storage node."""
    c: Context = ctx.obj
    if not probes:
        describe_all(c, "hosts", "/v1/hosts", output.HOST_COLUMNS)
        return
    hosts = pages(c, "/v1/hosts", "hosts", [("max_results", "1000")])["hosts"]
    rows = [{"host": h["name"], **p} for h in hosts for p in h.get("probes", [])]
    output.emit(rows, c.fmt, output.PROBE_COLUMNS)


@commands.command("advise")
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


@commands.command("describe-instances")
def describe_instances(ctx: typer.Context) -> None:
    """The VMs host agents discovered, with their attached volumes."""
    describe_all(ctx.obj, "instances", "/v1/instances", output.INSTANCE_COLUMNS)


@commands.command("describe-storage-nodes")
def describe_storage_nodes(ctx: typer.Context) -> None:
    """Storage nodes, their pools, free space and clone method (reflink or copy)."""
    describe_all(ctx.obj, "storage_nodes", "/v1/storage-nodes", output.NODE_COLUMNS)


@commands.command("describe-controllers")
def describe_controllers(ctx: typer.Context) -> None:
    """Controllers on this database: id, URL, last renewal, unfinished operations they hold, and the
    singleton loops (reconciler, housekeeping) they run."""
    describe_all(ctx.obj, "controllers", "/v1/controllers", output.CONTROLLER_COLUMNS)


@commands.command("drain-storage-node")
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


@commands.command("migrate-instance")
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
    emit_operation(c, move, wait=wait, label=f"migrating {instance_id}")


@commands.command("describe-availability-zones")
def describe_availability_zones(ctx: typer.Context) -> None:
    """The zones of the storage nodes: available while one of their nodes is up."""
    c: Context = ctx.obj
    body = c.client.call("GET", "/v1/availability-zones")
    output.emit(body if output.is_machine(c.fmt) else body["availability_zones"], c.fmt,
                output.ZONE_COLUMNS)
