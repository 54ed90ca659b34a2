"""What the NBD driver wants its daemon to hold (chains, host exports, copies, kept in ``exports.json``)
and what the daemon reports it holds; the names every node, export and job gets in the daemon.
No I/O here: the other modules of the package read and change these."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field

from vbs.storage.exports.supervised import ServedKey
from vbs.wire.qos import ExportLimits

ID_PREFIX = "vbs_"  # "_" never occurs in a key or a host name, so ids split back unambiguously
JOB_PREFIX = "vbs_copy_"
STATE_VERSION = 2
CHAIN_PREFIXES = ("vbsp", "vbsq", "vbsr", "vbsf")  # a chain's nodes: the same hash after these


# -- desired state ------------------------------------------------------------------------------


class Chain(BaseModel):
    """One opening of the key's file in the daemon: a file node, a raw node on it, and above it the
    throttle node of the key's own group, then (where the node shares out its volume type) the one of
    the type's fair-dispatch group. Chains of state files older than QoS have no throttle node."""

    gen: int = Field(ge=0)
    read_only: bool
    size: int | None = None  # bytes the raw node had when the daemon last opened it (None: unknown)
    file_node: str
    raw_node: str
    throttle_node: str | None = None
    fair_node: str | None = None
    fair_group: str | None = None

    def top(self) -> str:
        """The node exports go on."""
        return self.fair_node or self.throttle_node or self.raw_node

    def nodes(self) -> tuple[str, ...]:
        """Its nodes, each before its child (the order they are deleted in)."""
        return tuple(n for n in (self.fair_node, self.throttle_node, self.raw_node, self.file_node) if n)


class HostExport(BaseModel):
    """One host's NBD export of the key, on the chain of generation ``gen``."""

    host: str
    gen: int = Field(ge=0)
    read_only: bool
    name: str  # the NBD export name: the per-attachment secret-ish handle
    id: str  # QEMU's block export id


class Copy(BaseModel):
    """A point-in-time copy that was started (never re-created: its job cannot outlive the daemon)."""

    id: str
    gen: int = Field(ge=0)  # the chain it copies
    target: str
    size: int
    outcome: Literal["copying", "ready", "error"] = "copying"
    error: str | None = None


class View(BaseModel):
    """A point-in-time view of the key (fleecing, views.py): a copy-before-write filter between a chain's
    raw node and its throttle node, whose sparse ``scratch`` file takes the old data of every block
    written meanwhile, and a ``snapshot-access`` node shown read-only as the file ``mount`` (a FUSE export
    of the daemon). Never re-created: ``lost`` once its daemon is gone (its instant with it)."""

    id: str
    gen: int = Field(ge=0)  # the chain it sits in
    scratch: str
    mount: str
    size: int
    lost: bool = False


class Served(ServedKey):
    """Everything the daemon should hold of one key."""

    chains: list[Chain] = Field(default_factory=list)
    exports: list[HostExport] = Field(default_factory=list)
    copies: list[Copy] = Field(default_factory=list)
    views: list[View] = Field(default_factory=list)
    limits: ExportLimits | None = None  # what every export of the key may do together (None: unlimited)

    def chain(self, gen: int) -> Chain | None:
        return next((c for c in self.chains if c.gen == gen), None)

    def newest(self) -> Chain | None:
        return max(self.chains, key=lambda c: c.gen, default=None)

    def current(self, host: str) -> HostExport | None:
        """The host's newest export: what ``ensure_export`` answers."""
        return max((e for e in self.exports if e.host == host), key=lambda e: e.gen, default=None)

    def next_gen(self) -> int:
        return 1 + max([c.gen for c in self.chains] + [c.gen for c in self.copies] + [v.gen for v in self.views],
                       default=-1)


@dataclass(frozen=True)
class Book:
    """The driver's desired state as its collaborators reach it: the keys (looked up at each call:
    loading the state file replaces the dict), saving it, and recording a change before the daemon
    makes it (``undo`` runs if making it fails)."""

    desired: Callable[[], dict[str, Served]]
    save: Callable[[], None]
    first: Callable[[Callable[[], None]], AbstractContextManager[None]]

    def hosts_with_exports(self) -> set[str]:
        return {e.host for s in self.desired().values() for e in s.exports}

    def find_copy(self, copy_id: str) -> tuple[Served, Copy] | None:
        """The key a point-in-time copy is of, and the copy."""
        return next(((s, c) for s in self.desired().values() for c in s.copies if c.id == copy_id), None)

    def find_view(self, view_id: str) -> tuple[Served, View] | None:
        """The key a point-in-time view is of, and the view."""
        return next(((s, v) for s in self.desired().values() for v in s.views if v.id == view_id), None)


def export_id(key: str, host: str, gen: int) -> str:
    return f"{ID_PREFIX}{key}_{host}_{gen}"


def key_host(export_id: str) -> tuple[str, str] | None:
    """(key, host) of one of our export ids (also those of earlier versions), None for anyone else's."""
    if not export_id.startswith(ID_PREFIX) or export_id.startswith(JOB_PREFIX):
        return None
    parts = export_id[len(ID_PREFIX):].split("_")
    if len(parts) == 2 or (len(parts) == 3 and parts[2].isdigit()):
        return parts[0], parts[1]
    return None


def hashed(text: str) -> str:
    # QEMU caps node names at 31 characters, too short for a key plus a 63-character host name:
    # a hash keeps them deterministic ("vbs" + one letter + 24 hex digits).
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def new_chain(key: str, gen: int, read_only: bool, fair_group: str | None) -> Chain:
    h = hashed(f"{key}/{gen}")
    return Chain(gen=gen, read_only=read_only, file_node=f"vbsf{h}", raw_node=f"vbsr{h}", throttle_node=f"vbsq{h}",
                 fair_node=f"vbsp{h}" if fair_group else None, fair_group=fair_group)


def group_id(key: str) -> str:
    """The throttle group of one key: every export of it, on every chain, shares its limits."""
    return f"vbsg{hashed(key)}"


def fair_group_id(volume_type: str) -> str:
    return f"vbsfair-{volume_type}"


def copy_names(copy_id: str) -> tuple[str, str, str]:
    """The job id, target node and copy-before-write filter node of a copy."""
    h = hashed(copy_id)
    return f"{JOB_PREFIX}{copy_id}", f"vbst{h}", f"vbsc{h}"


VIEW_PREFIXES = ("vbsv", "vbsw", "vbsl", "vbsx")  # a view's nodes, each before its child
VIEW_EXPORT_PREFIX = "vbsview"  # its FUSE export (not an NBD export: key_host() ignores it)


class ViewNodes(NamedTuple):
    access: str  # snapshot-access: the view
    cbw: str  # the copy-before-write filter
    link: str  # a raw node under the filter, which a later view's removal can point elsewhere
    scratch: str  # the scratch file's node, the filter's target
    export: str  # the FUSE export of the access node


def view_names(view_id: str) -> ViewNodes:
    h = hashed(view_id)
    return ViewNodes(f"vbsv{h}", f"vbsw{h}", f"vbsl{h}", f"vbsx{h}", f"{VIEW_EXPORT_PREFIX}{h}")


def upgrade_v1(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Version 1 had one chain per (volume, host, generation). Each becomes a chain of its own with
    the same node names and export id, so a daemon adopted under running exports serves on
    untouched; later exports of the volume go on its newest chain."""
    olds: dict[str, list[dict[str, Any]]] = {}
    for item in data["exports"]:
        olds.setdefault(str(item["volume_id"]), []).append(item)
    items: list[dict[str, Any]] = []
    for key, group in olds.items():
        group.sort(key=lambda x: (int(x.get("gen", 0)), str(x["host"])))
        chains: list[dict[str, Any]] = []
        exports: list[dict[str, Any]] = []
        gen = -1
        for old in group:
            legacy_gen = int(old.get("gen", 0))
            # Never below the export's own generation: the ids of later exports
            # (vbs_<key>_<host>_<chain>) then never meet an adopted one.
            gen = max(gen + 1, legacy_gen)
            old_id = f"{ID_PREFIX}{key}_{old['host']}" + (f"_{legacy_gen}" if legacy_gen else "")
            h = hashed(old_id)
            chains.append({"gen": gen, "read_only": old["read_only"], "size": old.get("size"),
                           "file_node": f"vbsf{h}", "raw_node": f"vbsr{h}"})
            exports.append({"host": old["host"], "gen": gen, "read_only": old["read_only"],
                            "name": old["name"], "id": old_id})
        items.append({"key": key, "path": group[-1]["path"], "chains": chains, "exports": exports})
    return items


def fits(chain: Chain, read_only: bool, size: int) -> bool:
    """Whether a host's export may go on ``chain``: the file's current size, and writable if needed."""
    return chain.size == size and (read_only or not chain.read_only)


# -- what the daemon has --------------------------------------------------------------------------


@dataclass
class Job:
    status: str
    error: str | None
    done: int
    total: int

    def percent(self) -> int:
        # Never 100 while it runs: 100 is for a finished copy.
        return min(99, self.done * 100 // self.total) if self.total else 0


@dataclass
class Live:
    exports: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> query-block-exports entry
    nodes: dict[str, int | None] = field(default_factory=dict)  # node name -> virtual size
    jobs: dict[str, Job] = field(default_factory=dict)  # our copy jobs by job id
    groups: set[str] = field(default_factory=set)  # throttle groups (QOM objects) the daemon has
