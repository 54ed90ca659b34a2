"""Rendering API answers: Rich tables on a terminal, JSON (same field names as the REST API) for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vbs.errors import InvalidParameter

# Rich loads when a table is drawn: JSON, YAML and text answers (scripts) do without it.
if TYPE_CHECKING:
    from rich.console import Console

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def field(title: str, key: str) -> Column:
    """A column that shows one field of a row as it is."""
    return title, lambda row: row[key]


def moment(title: str, key: str) -> Column:
    """A column that shows a timestamp field to the second (``2024-05-01T12:00:00``)."""
    return title, lambda row: row[key][:19]


def node_version(node: dict[str, Any]) -> str:
    """A node's VBS release and wire version, as its heartbeats named them."""
    release, wire = node.get("vbs_version"), node.get("wire_version")
    return f"{release or 'unknown'} (wire {wire})" if wire is not None else "unknown"


def _attachments(v: dict[str, Any]) -> str:
    return ", ".join(f"{a['instance_id'] or a['vm_id']}@{a['host']}:{a['device']} ({a['state']})"
                     for a in v.get("attachments", []))


def _tags(x: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(x.get("tags", {}).items()))


def _progress(x: dict[str, Any]) -> str:
    return f"{x['progress']}%" if x["status"] in ("creating", "pending") else ""


VOLUME_COLUMNS: list[Column] = [
    field("VolumeId", "volume_id"),
    ("Size", lambda v: f"{v['size_gib']} GiB"),
    field("Status", "status"),
    ("Progress", _progress),
    ("Snapshot", lambda v: v["snapshot_id"] or ""),
    ("Node", lambda v: f"{v['storage_node']}/{v['pool']}"
     + (" (local" + (", persistent)" if v.get("persistent") else ")") if v.get("placement") == "local" else "")),
    ("Zone", lambda v: v.get("availability_zone", "")),
    ("Check", lambda v: v.get("volume_status", "")),
    ("Attachments", _attachments),
    field("Comment", "comment"),
    ("Tags", _tags),
    moment("Created", "created_at"),
]

PERMISSION_COLUMNS: list[Column] = [
    field("SnapshotId", "snapshot_id"),
    ("SharedWith", lambda p: ", ".join(p["create_volume_permission"]) or "(no one)"),
]
SNAPSHOT_COLUMNS: list[Column] = [
    field("SnapshotId", "snapshot_id"),
    field("VolumeId", "volume_id"),
    ("Size", lambda s: f"{s['volume_size_gib']} GiB"),
    field("Status", "status"),
    ("Progress", lambda s: f"{s['progress']}%"),
    ("Location", lambda s: str(s.get("data_location") or "pool")),
    field("Comment", "comment"),
    ("Tags", _tags),
    moment("Started", "started_at"),
]


def _change(before: str, after: str, unit: str = "") -> Callable[[dict[str, Any]], str]:
    """``gp2 → gp3``; one value where it does not change."""
    def show(m: dict[str, Any]) -> str:
        old, new = m.get(before), m.get(after)
        text = [f"{v}{unit}" if v is not None else "-" for v in (old, new)]
        return text[1] if old == new else f"{text[0]} → {text[1]}"
    return show


MODIFICATION_COLUMNS: list[Column] = [
    field("VolumeId", "volume_id"),
    field("State", "state"),
    ("Progress", lambda m: f"{m['progress']}%"),
    ("Size", _change("original_size_gib", "target_size_gib", " GiB")),
    ("Type", _change("original_volume_type", "target_volume_type")),
    ("Iops", _change("original_iops", "target_iops")),
    ("Throughput", _change("original_throughput", "target_throughput", " MB/s")),
    ("Message", lambda m: m.get("status_message") or ""),
]

ATTACHMENT_COLUMNS: list[Column] = [
    field("AttachmentId", "attachment_id"),
    field("VolumeId", "volume_id"),
    ("Instance", lambda a: a["instance_id"] or ""),
    field("Host", "host"),
    field("VM", "vm_id"),
    field("Device", "device"),
    field("Mode", "mode"),
    field("State", "state"),
]

HOST_COLUMNS: list[Column] = [
    field("Name", "name"),
    field("State", "state"),
    field("Address", "address"),
    field("URL", "url"),
    field("VMs", "instances"),
    ("RTT to storage", lambda h: ", ".join(f"{p['storage_node']} {p['rtt_ms']:.2f} ms" for p in h.get("probes", []))),
    ("Local pools", lambda h: ", ".join(f"{p['name']}: {p['free_bytes'] / 2**30:.1f}/{p['capacity_bytes'] / 2**30:.1f}"
                                        " GiB free" for p in h.get("local_pools", []))),
    ("Version", node_version),
    moment("Last heartbeat", "last_heartbeat"),
]

# A host's link to a storage node as it measured it: in describe-hosts --probes and in advise's options.
LINK_COLUMNS: list[Column] = [
    field("Host", "host"),
    field("StorageNode", "storage_node"),
    ("RTT ms", lambda x: f"{x['rtt_ms']:.3f}"),
    ("MiB/s", lambda x: f"{x['mbps']:.1f}"),
]

# `vbs describe-hosts --probes`: one row per host and storage node it probed.
PROBE_COLUMNS: list[Column] = [
    *LINK_COLUMNS,
    field("Probe bytes", "probe_bytes"),
    moment("Measured", "measured_at"),
]

ADVICE_COLUMNS: list[Column] = [
    field("Action", "action"),
    *LINK_COLUMNS,
    ("IOPS", lambda o: f"{o['iops']:.0f}"),
    ("Move s", lambda o: f"{o['move_s']:.2f}"),
    ("I/O s", lambda o: f"{o['io_s']:.2f}"),
    ("Total s", lambda o: f"{o['total_s']:.2f}"),
    ("Pays from GiB", lambda o: "" if o["breakeven_io_gib"] is None else f"{o['breakeven_io_gib']:.2f}"),
    ("Command", lambda o: o["command"] or ""),
]

INSTANCE_COLUMNS: list[Column] = [
    field("InstanceId", "instance_id"),
    field("Host", "host"),
    field("VM", "vm_id"),
    field("Name", "name"),
    field("State", "state"),
    ("Volumes", lambda i: ", ".join(f"{a['volume_id']}:{a['device']} ({a['state']})" for a in i["volumes"])),
]

# The node and pool a row of `vbs check`'s pool details belongs to.
AT_POOL: Column = ("Node", lambda x: f"{x['node']}/{x['pool']}")
TIER_COLUMNS: list[Column] = [
    ("SnapshotId", lambda x: x["snapshot_id"]),
    ("Tier", lambda x: x["storage_tier"]),
    ("LastOperation", lambda x: x.get("last_status") or ""),
    ("RestoredUntil", lambda x: x.get("restore_expires_at") or ""),
]
LOCK_COLUMNS: list[Column] = [
    ("SnapshotId", lambda x: x["snapshot_id"]),
    ("State", lambda x: x["lock_state"]),
    ("Until", lambda x: x["expires_at"]),
    ("CoolOffUntil", lambda x: x.get("cool_off_expires_at") or ""),
]
BLOCK_COLUMNS: list[Column] = [
    ("Block", lambda b: b["BlockIndex"]),
    ("Token", lambda b: b.get("BlockToken") or b.get("SecondBlockToken") or "(zeros)"),
    ("First", lambda b: b.get("FirstBlockToken", "(zeros)") if "SecondBlockToken" in b or "FirstBlockToken" in b
     else ""),
]

TRASH_COLUMNS: list[Column] = [
    AT_POOL,
    field("ImageId", "id"),
    field("Name", "name"),
    field("KeptFor", "kept_for"),
    field("Snapshots", "snapshots"),
    field("DeletedSnapshotsWithClones", "children"),
]

CHAIN_COLUMNS: list[Column] = [
    AT_POOL,
    field("VolumeId", "volume_id"),
    field("Depth", "depth"),
    ("Chain", lambda c: " <- ".join([c["volume_id"], *c["parents"]])),
]

FLATTEN_COLUMNS: list[Column] = [
    AT_POOL,
    field("VolumeId", "volume_id"),
    field("State", "state"),
    ("Progress", lambda f: f"{f['progress']}%"),
]

STORE_CHECK_COLUMNS: list[Column] = [
    field("Store", "store"),
    field("CheckedBy", "node"),
    field("Snapshots", "snapshots"),
    field("Chunks", "chunks_checked"),
    ("Read", lambda r: f"{r['bytes_checked'] / 2**20:.1f} MiB" if r["deep"] else "-"),
]

UNSTORED_COLUMNS: list[Column] = [
    field("SnapshotId", "snapshot_id"),
    field("State", "status"),
    field("Upload", "store_state"),
    field("Store", "store"),
    field("Reason", "reason"),
]

FINDING_COLUMNS: list[Column] = [
    field("Kind", "kind"),
    field("Node", "node"),
    field("Resource", "resource_id"),
    field("Detail", "detail"),
    field("Action", "action"),
]

KEY_COLUMNS: list[Column] = [
    field("AccessKeyId", "access_key_id"),
    field("Tenant", "tenant"),
    field("Role", "role"),
    ("Source", lambda k: "bootstrap" if k["bootstrap"] else "create-key"),
]

CONTROLLER_COLUMNS: list[Column] = [
    field("Id", "controller_id"),
    field("State", "state"),
    field("URL", "url"),
    moment("Last seen", "last_seen"),
    ("Operations held", lambda c: str(c["operations_held"])),
    ("Runs", lambda c: ", ".join(c["singletons"])),
]

NODE_COLUMNS: list[Column] = [
    field("Name", "name"),
    ("State", lambda n: n["state"] + (", drained" if n.get("drained") else "")),
    ("Zone", lambda n: n.get("availability_zone", "")),
    field("URL", "url"),
    ("Pools", lambda n: ", ".join(
        f"{p['name']}: {p['free_bytes'] / 2**30:.1f}/{p['capacity_bytes'] / 2**30:.1f} GiB free ({p['clone_method']})"
        + (", FULL" if p.get("full") else "") for p in n["pools"])),
    ("Version", node_version),
    moment("Last heartbeat", "last_heartbeat"),
]


RESIDENT_COLUMNS: list[Column] = [
    field("Id", "id"),
    field("Tenant", "tenant"),
    field("Pool", "pool"),
    ("Size", lambda r: f"{r['size_gib']} GiB"),
    field("Status", "status"),
]

ZONE_COLUMNS: list[Column] = [
    field("Zone", "zone_name"),
    field("ZoneId", "zone_id"),
    field("Region", "region_name"),
    field("State", "state"),
]


FORMATS = ("auto", "table", "json", "yaml", "text")


class _Settings:
    """The invocation's --output and --query (one CLI process answers one command)."""

    machine = "json"  # how whole answers print: json, yaml, text, or a generic table (--query on a terminal)
    query: Any = None  # a compiled JMESPath expression
    columns: list[str] = []  # --columns: the table's columns, by name


_settings = _Settings()


def configure(fmt: str, query: str | None, columns: str | None = None) -> None:
    """Set --output, --query and --columns; an invalid query raises ValueError with JMESPath's reason."""
    _settings.columns = [c.strip() for c in columns.split(",") if c.strip()] if columns else []
    resolved = resolve_format(fmt)
    _settings.query = None
    if query is not None:
        import jmespath

        try:
            _settings.query = jmespath.compile(query)
        except jmespath.exceptions.JMESPathError as exc:
            raise ValueError(f"--query: {exc}") from exc
    _settings.machine = resolved if resolved != "table" else ("table" if query is not None else "json")


def resolve_format(fmt: str) -> str:
    if fmt == "auto":
        return "table" if sys.stdout.isatty() else "json"
    return fmt


def is_machine(fmt: str) -> bool:
    """Whether the whole answer is printed (json, yaml, text, or a --query result), not its table."""
    return resolve_format(fmt) != "table" or _settings.query is not None


def emit(data: Any, fmt: str, columns: list[Column] | None = None, *, title: str | None = None) -> None:
    if is_machine(fmt) or columns is None:
        _print_whole(_settings.query.search(data) if _settings.query is not None else data)
        return
    from rich.console import Console

    rows = data if isinstance(data, list) else [data]
    # Piped into a file or another program, lines need not fit a terminal.
    console = Console(width=None if sys.stdout.isatty() else 250)
    print_table(console, rows, columns, title=title)


# Never cut: what people copy (the first column, an id) and what they look for (a status).
_UNCUT = {"Status", "State"}
# Kept first when the terminal is narrow, after the id: then the rest in their order.
_IMPORTANT = ("Status", "State", "Size", "Attachments", "Instance", "VolumeId", "Host", "VM")


def choose_columns(columns: list[Column], names: list[str]) -> list[Column]:
    """The columns ``--columns`` names (case-insensitive), in its order; an unknown one is an error."""
    by_name = {name.lower(): (name, get) for name, get in columns}
    unknown = [n for n in names if n.lower() not in by_name]
    if unknown:
        raise InvalidParameter(f"--columns: no column {', '.join(unknown)} (this table has: "
                               f"{', '.join(name for name, _ in columns)})")
    return [by_name[n.lower()] for n in names]


def print_table(console: Console, rows: list[dict[str, Any]], columns: list[Column], *,
                title: str | None = None) -> None:
    """A table that fits the console: with ``--columns`` those columns; else, when the columns do not
    fit, the least important ones are left out (never the id or the status, which are never cut)."""
    from rich.table import Table

    if _settings.columns:
        columns = choose_columns(columns, _settings.columns)
    cells = [[str(get(row)) for _, get in columns] for row in rows]
    widths = [max([len(name), *(len(r[i]) for r in cells)]) for i, (name, _) in enumerate(columns)]
    keep = list(range(len(columns)))
    if not _settings.columns:
        rank = sorted(range(1, len(columns)), key=lambda i: (
            _IMPORTANT.index(columns[i][0]) if columns[i][0] in _IMPORTANT else len(_IMPORTANT), i))
        while len(keep) > 1 and sum(widths[i] + 3 for i in keep) + 1 > console.width:
            droppable = [i for i in reversed(rank) if i in keep and columns[i][0] not in _UNCUT]
            if not droppable:
                break
            keep.remove(droppable[0])
    table = Table(title=title)
    for i in keep:
        name = columns[i][0]
        uncut = i == 0 or name in _UNCUT
        table.add_column(name, no_wrap=uncut, min_width=widths[i] if uncut else len(name))
    for r in cells:
        table.add_row(*(r[i] for i in keep))
    console.print(table)
    if len(keep) < len(columns):
        left = ", ".join(columns[i][0] for i in range(len(columns)) if i not in keep)
        console.print(f"(hidden at this width: {left}; --columns chooses)",
                      style="dim")


def _print_whole(data: Any) -> None:
    kind = _settings.machine
    if kind == "yaml":
        import yaml

        print(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False), end="")
    elif kind == "text":
        for line in _text(data):
            print(line)
    elif kind == "table":
        _generic_table(data)
    else:
        print(json.dumps(data, indent=2))


def _scalar(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value) if not isinstance(value, dict | list) else json.dumps(value)


def _text(data: Any) -> list[str]:
    """The AWS CLI's text form: a list of scalars on one line, tab-separated; a record's scalar
    values on one line (in the API's field order), its lists below it."""
    if isinstance(data, list):
        if all(not isinstance(x, dict | list) for x in data):
            return ["\t".join(_scalar(x) for x in data)] if data else []
        return [line for x in data for line in _text(x)]
    if isinstance(data, dict):
        scalars = [_scalar(v) for v in data.values() if not isinstance(v, dict | list)]
        lines = ["\t".join(scalars)] if scalars else []
        for value in data.values():
            if isinstance(value, dict | list):
                lines += _text(value)
        return lines
    return [_scalar(data)]


def _generic_table(data: Any) -> None:
    """A --query result on a terminal: records as rows, a list as one column, a record as key/value."""
    from rich.console import Console
    from rich.table import Table

    table = Table()
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        keys = list(dict.fromkeys(k for x in data for k in x))
        for k in keys:
            table.add_column(k, no_wrap=True)
        for x in data:
            table.add_row(*(_scalar(x.get(k, "")) for k in keys))
    elif isinstance(data, list):
        table.add_column("Value", no_wrap=True)
        for x in data:
            table.add_row(_scalar(x))
    elif isinstance(data, dict):
        table.add_column("Key", no_wrap=True)
        table.add_column("Value")
        for k, v in data.items():
            table.add_row(str(k), _scalar(v))
    else:
        print(_scalar(data))
        return
    Console(width=None if sys.stdout.isatty() else 250).print(table)
