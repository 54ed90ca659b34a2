"""Point-in-time views the NBD daemon gives of what it serves, without copying it (QEMU's image
fleecing, docs/snapshots.md "Snapshots go to the store"): the snapshot store's upload reads the view
while hosts keep writing to the volume, and the pool needs room only for what they overwrite meanwhile.

A view is, in the daemon, a ``copy-before-write`` filter put between a chain's raw node and its
throttle node (``blockdev-reopen`` of the throttle node: every export of the chain writes through it),
whose target is a sparse scratch file that takes the old data of each block a host overwrites, and a
``snapshot-access`` node on the filter that reads the volume as it was when the filter went in. The
daemon shows that node as a read-only file (a FUSE export on a 0600 file in the driver's 0700 state
directory), which the upload reads as it reads any snapshot file (holes found with SEEK_DATA).

The filter runs with ``on-cbw-error=break-snapshot`` and a ``cbw-timeout``: a scratch file that cannot
be written (a full pool) or a copy that hangs breaks the view, never a host's write. A view cannot
survive its daemon: one whose nodes are gone is ``lost`` (its instant with it), and its scratch file
and stale mount are removed at the next reconciliation, as are view nodes no record names.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vbs.errors import DriverError, RetryLater
from vbs.storage.exports.supervised import file_size
from vbs.system import argv
from vbs.system.mounts import is_mounted

from .chains import Chains
from .daemon import Monitor
from .limits import Limits
from .state import VIEW_EXPORT_PREFIX, VIEW_PREFIXES, Book, Chain, Live, Served, View, group_id, new_chain, view_names

log = logging.getLogger(__name__)

LOST = "the point-in-time view was lost with its export daemon; its point in time is lost"
# A copy-before-write that takes longer breaks the view rather than holding a host's write.
CBW_TIMEOUT_S = 60


def unmount_stale(path: Path) -> None:
    """Unmount what a dead daemon left on ``path`` (its FUSE connection is gone: every access fails)."""
    if not is_mounted(path):
        return
    if argv.run(["umount", str(path)], timeout=30, check=False).returncode != 0:
        argv.run(["umount", "--lazy", str(path)], timeout=30, check=False)
    log.info("unmounted the stale point-in-time view %s", path)


class Views:
    """Starts, checks and ends the views the desired state in ``book`` records; their mount files live
    in ``views_dir``."""

    def __init__(self, monitor: Monitor, chains: Chains, limits: Limits, book: Book, views_dir: Path) -> None:
        self.views_dir = views_dir
        self._monitor, self._chains, self._limits, self._book = monitor, chains, limits, book

    def find(self, view_id: str) -> tuple[Served, View] | None:
        return self._book.find_view(view_id)

    def _chain_for(self, served: Served, size: int) -> Chain:
        """The chain every writer of the key uses (a new writable one if it has none)."""
        chain = served.newest()
        if chain is not None and any(not e.read_only and e.gen != chain.gen for e in served.exports):
            raise RetryLater(f"hosts of {served.key} do not all write through its newest chain yet "
                             "(a resize is not finished); take its point-in-time view after")
        if chain is None or chain.read_only:
            # No writer: a writable chain of its own, which a host that attaches meanwhile joins.
            return new_chain(served.key, served.next_gen(), False, self._limits.fair_group(served))
        if chain.size != size:
            raise RetryLater(f"{served.key} grew and its exports are not refreshed yet; take its view after")
        if chain.throttle_node is None:
            raise DriverError(f"{served.key} is served through a chain of an older agent, with no node a view can "
                              "go under: detach and attach it again to snapshot it")
        return chain

    def start(self, view_id: str, served: Served, scratch: Path, live: Live) -> tuple[Served, View]:
        size = file_size(served.key, Path(served.path))
        chain = self._chain_for(served, size)
        self.views_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.views_dir.chmod(0o700)  # the boundary of the files that show views: only the agent's user
        view = View(id=view_id, gen=chain.gen, scratch=str(scratch), mount=str(self.views_dir / view_id), size=size)
        if served.chain(chain.gen) is None:
            served.chains.append(chain)
        served.views.append(view)
        self._book.desired()[served.key] = served

        def undo() -> None:
            try:
                self.close(served, view, live)
            except DriverError as exc:
                log.error("could not undo the start of view %s: %s", view_id, exc.message)
            served.views.remove(view)
            try:
                self._chains.collect(served, live)
            except DriverError as exc:
                log.error("could not close the chain of view %s: %s", view_id, exc.message)

        with self._book.first(undo):  # recorded before the daemon has it: a restart then finds it lost
            self._chains.open_chain(served, chain, live)
            self.close(served, view, live)  # the leftovers of an interrupted start
            _new_file(scratch, size)
            _new_file(Path(view.mount), 0)
            # Before the instant: the bitmap may count writes from before it, never miss one after it.
            self._chains.tracking.start(chain.raw_node, view_id)
            self._insert(served, chain, view, live)
            self._book.save()  # with the size of a new chain
        log.info("point-in-time view %s of %s at %s (scratch %s)", view_id, served.key, view.mount, scratch)
        return served, view

    def _stack(self, served: Served, gen: int, live: Live) -> list[View]:
        """The views in chain ``gen`` whose filter the daemon has, lowest first (each later one went in
        above the earlier ones)."""
        return [v for v in served.views if v.gen == gen and not v.lost and view_names(v.id).cbw in live.nodes]

    def _insert(self, served: Served, chain: Chain, view: View, live: Live) -> None:
        names = view_names(view.id)
        below = [v for v in self._stack(served, chain.gen, live) if v is not view]
        # Written through the page cache, as a copy's target: only what hosts overwrite lands there.
        self._chains.add_file_node(names.scratch, view.scratch, read_only=False, what=view.id, buffered=True)
        live.nodes[names.scratch] = view.size
        self._add(names.link, {"driver": "raw", "file": view_names(below[-1].id).cbw if below else chain.raw_node},
                  live, view.size)
        self._add(names.cbw, {"driver": "copy-before-write", "file": names.link, "target": names.scratch,
                              "on-cbw-error": "break-snapshot", "cbw-timeout": CBW_TIMEOUT_S}, live, view.size)
        self._reopen(served, chain, None, names.cbw)
        self._add(names.access, {"driver": "snapshot-access", "file": names.cbw}, live, view.size)
        self._monitor.q("block-export-add", {"type": "fuse", "id": names.export, "node-name": names.access,
                                             "mountpoint": view.mount, "writable": False, "allow-other": "off"})
        live.exports[names.export] = {"id": names.export, "node-name": names.access}

    def _add(self, node: str, options: dict[str, Any], live: Live, size: int) -> None:
        self._monitor.q("blockdev-add", {"node-name": node, **options})
        live.nodes[node] = size

    def _reopen(self, served: Served, chain: Chain, above: View | None, child: str) -> None:
        """Point the node above a view's filter at ``child``: the chain's throttle node (the filter is the
        topmost), or the link node of the view ``above`` it (a filter cannot be reopened; a raw node can)."""
        options: dict[str, Any]
        if above is None:
            assert chain.throttle_node is not None
            options = {"driver": "throttle", "node-name": chain.throttle_node, "throttle-group": group_id(served.key),
                       "file": child, "read-only": chain.read_only}
        else:
            options = {"driver": "raw", "node-name": view_names(above.id).link, "file": child}
        self._monitor.q("blockdev-reopen", {"options": [options]})

    def changes(self, served: Served, view: View, since: str) -> list[tuple[int, int]] | None:
        """The byte extents hosts may have written between the instants of view ``since`` (of an earlier
        snapshot) and ``view``: from the bitmap ``since`` started in the chain ``view`` sits in (tracking.py).
        None: that chain has no such bitmap (another chain, the daemon restarted, or ``since`` was not a view
        of this volume)."""
        chain = served.chain(view.gen)
        if chain is None:
            return None
        return self._chains.tracking.changes(chain.raw_node, since, view.size)

    def alive(self, view: View, live: Live) -> bool:
        names = view_names(view.id)
        return (not view.lost and names.export in live.exports
                and all(n in live.nodes for n in (names.access, names.cbw, names.link, names.scratch)))

    def close(self, served: Served, view: View, live: Live) -> None:
        """Take the view out of the daemon (writes no longer pass its filter) and remove its files."""
        names = view_names(view.id)
        self._chains.close_export(names.export, live)
        self._chains.del_nodes((names.access,), live)
        chain = served.chain(view.gen)
        stack = self._stack(served, view.gen, live)
        if view in stack and chain is not None and chain.throttle_node in live.nodes:
            k = stack.index(view)
            below = view_names(stack[k - 1].id).cbw if k > 0 else chain.raw_node
            self._reopen(served, chain, stack[k + 1] if k + 1 < len(stack) else None, below)
        self._chains.del_nodes((names.cbw, names.link, names.scratch), live)
        unmount_stale(Path(view.mount))
        Path(view.mount).unlink(missing_ok=True)
        Path(view.scratch).unlink(missing_ok=True)

    def check(self, served: Served, live: Live) -> bool:
        """Views whose daemon lost them are ``lost``: their leftovers go. Returns whether any changed."""
        changed = False
        for view in served.views:
            if view.lost or self.alive(view, live):
                continue
            view.lost = True
            log.warning("point-in-time view %s of %s is gone with its daemon: its point in time is lost",
                        view.id, served.key)
            try:
                self.close(served, view, live)
            except DriverError as exc:
                log.error("could not remove what is left of view %s: %s", view.id, exc.message)
            changed = True
        return changed

    def sweep(self, live: Live) -> None:
        """Remove view exports, nodes and mount files that no record names (a state file lost); a filter
        still in a chain's write path is taken out of it first."""
        known = {view_names(v.id).cbw[4:] for s in self._book.desired().values() for v in s.views}
        mounts = {v.mount for s in self._book.desired().values() for v in s.views}
        for export_id in [e for e in live.exports if e.startswith(VIEW_EXPORT_PREFIX)]:
            if export_id[len(VIEW_EXPORT_PREFIX):] not in known:
                self._chains.close_export(export_id, live)
        stale = [n for n in live.nodes if n.startswith(VIEW_PREFIXES) and n[4:] not in known]
        for prefix in VIEW_PREFIXES:  # parents first; filters out of the write path before they go
            if prefix == "vbsw" and stale:
                self._unlink_stale({n for n in stale if n.startswith(prefix)})
            for node in [n for n in stale if n.startswith(prefix)]:
                try:
                    self._chains.del_nodes((node,), live)
                except DriverError as exc:
                    log.error("could not remove the stale view node %s: %s", node, exc.message)
        if self.views_dir.is_dir():
            for entry in self.views_dir.iterdir():
                if str(entry) not in mounts:
                    unmount_stale(entry)
                    entry.unlink(missing_ok=True)

    def _unlink_stale(self, filters: set[str]) -> None:
        """Point the parent of each stale filter (a throttle node of a known chain, or a view's link node)
        at what is under the filter's link node, read from the daemon's block graph."""
        graph = self._monitor.q("x-debug-query-block-graph")
        name = {n["id"]: str(n["name"]) for n in graph["nodes"]}
        children = {(name[e["parent"]], e["name"]): name[e["child"]] for e in graph["edges"]}
        parents = {name[e["child"]]: name[e["parent"]] for e in graph["edges"] if e["name"] == "file"}
        chains = {c.throttle_node: (s, c) for s in self._book.desired().values() for c in s.chains}
        for cbw in sorted(filters):
            parent = parents.get(cbw)
            below = children.get((children.get((cbw, "file"), ""), "file"))
            if parent is None or below is None:
                continue
            options: dict[str, Any] = {"driver": "raw", "node-name": parent, "file": below}
            if parent in chains:
                served, chain = chains[parent]
                options = {"driver": "throttle", "node-name": parent, "throttle-group": group_id(served.key),
                           "file": below, "read-only": chain.read_only}
            elif not parent.startswith("vbsl"):
                log.error("the stale view filter %s sits under %s, which no record names: it stays until the "
                          "daemon restarts", cbw, parent)
                continue
            self._monitor.q("blockdev-reopen", {"options": [options]})
            log.info("took the stale view filter %s out of the write path of %s", cbw, parent)


def _new_file(path: Path, size: int) -> None:
    """A new empty (sparse) 0600 file of ``size`` bytes, replacing a leftover."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise DriverError(f"cannot make {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
