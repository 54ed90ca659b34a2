"""The NBD daemon's block graph: each key's chains (file or RBD node, format node, throttle nodes),
the host exports on them, and closing what nothing uses any more. One ``Chains`` per driver."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from vbs.errors import DriverError
from vbs.qemu.qmp import QmpCommandError, QmpConnectionError, QmpError
from vbs.storage.exports.supervised import ServedImage

from .daemon import Monitor
from .limits import Limits
from .state import CHAIN_PREFIXES, Book, Chain, HostExport, Live, Served, copy_names, group_id, key_host
from .tracking import Tracking

log = logging.getLogger(__name__)


class Chains:
    """Opens and closes chains and exports in the daemon, as the desired state in ``book`` has them."""

    def __init__(self, monitor: Monitor, limits: Limits, book: Book, tracking: Tracking, *, aio: str,
                 cache_direct: bool) -> None:
        self.aio, self.cache_direct = aio, cache_direct  # how file nodes open their files
        self._monitor, self._limits, self._book = monitor, limits, book
        self.tracking = tracking  # changed-block bitmaps (tracking.py): none may miss a new chain's writes
        self._fallback_told = False  # the pool's file system refused the configured mode: said once

    # -- nodes --------------------------------------------------------------------------------------

    def _file_attempts(self) -> list[tuple[bool, str]]:
        attempts = [(self.cache_direct, self.aio)]
        if self.aio != "threads":
            attempts.append((self.cache_direct, "threads"))
        if self.cache_direct:
            attempts.append((False, "threads"))  # a filesystem without O_DIRECT (tmpfs before Linux 6.6)
        return attempts

    def add_file_node(self, node: str, path: str, *, read_only: bool, what: str, buffered: bool = False) -> None:
        """A file node in the configured mode, or the first fallback the file system takes; ``buffered``:
        through the page cache whatever the mode (``cache.direct`` off, ``aio=threads``), by choice: a
        copy's target (a snapshot's file), which nothing refused and nothing needs saying about."""
        if buffered:
            try:
                self._add_file_node(node, path, read_only, False, "threads")
            except QmpCommandError as exc:
                raise DriverError(f"cannot open {path} for {what}: {exc.desc}") from exc
            log.debug("%s: %s written through the page cache (a copy's target, flushed before it is used)",
                      what, path)
            return
        err: QmpCommandError | None = None
        for direct, aio in self._file_attempts():
            try:
                self._add_file_node(node, path, read_only, direct, aio)
            except QmpCommandError as exc:
                err = err or exc
                log.log(logging.DEBUG if self._fallback_told else logging.INFO,
                        "%s: file node with cache.direct=%s aio=%s refused: %s", what, direct, aio, exc.desc)
                continue
            if (direct, aio) != (self.cache_direct, self.aio):
                self._tell_fallback(what, direct, aio)
            return
        assert err is not None
        raise DriverError(f"cannot open {path} for {what}: {err.desc}") from err

    def _add_file_node(self, node: str, path: str, read_only: bool, direct: bool, aio: str) -> None:
        self._monitor.q("blockdev-add", {
            "driver": "file", "node-name": node, "filename": path, "cache": {"direct": direct},
            "aio": aio, "read-only": read_only,
            "discard": "unmap",  # guest TRIM punches holes: files stay thin
        })

    def _tell_fallback(self, what: str, direct: bool, aio: str) -> None:
        """A file system that refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE and network file
        systems) or the configured AIO engine is a normal case, not a fault: say once per pool what it
        means. (A copy's target, buffered by choice, never comes here: see ``add_file_node``.)"""
        if self._fallback_told:
            log.debug("%s: serving with cache.direct=%s aio=%s", what, direct, aio)
            return
        self._fallback_told = True
        means = ("its exports go through the page cache instead of O_DIRECT (the guest's flushes still "
                 "reach the disk; the page cache holds the data meanwhile)" if self.cache_direct and not direct
                 else f"its exports use aio={aio} instead of aio={self.aio}")
        log.info("%s: the export daemon refused cache.direct=%s aio=%s for this file (its reason is logged just "
                 "before; file systems without O_DIRECT, such as tmpfs before Linux 6.6, always do), so %s. Data "
                 "stays as safe as before: nothing needs doing (said once per pool)",
                 what, self.cache_direct, self.aio, means)

    def _add_rbd_node(self, node: str, image: ServedImage, *, read_only: bool, what: str) -> None:
        """A node on an RBD image, opened by the daemon's librbd. The cephx key is read by librbd
        from the keyring file the conf names: nothing secret crosses QMP or lands in a log.
        ``cache.direct`` turns librbd's write-back cache off: a write is acknowledged once the
        OSDs have it, as a file node's O_DIRECT write is once the disk has it."""
        try:
            self._monitor.q("blockdev-add", {
                "driver": "rbd", "node-name": node, "pool": image.pool, "image": image.image,
                "conf": image.conf, "user": image.user, "cache": {"direct": self.cache_direct},
                "read-only": read_only, "discard": "unmap",
            })
        except QmpCommandError as exc:
            raise DriverError(f"cannot open the RBD image {image.pool}/{image.image} for {what}: {exc.desc}") from exc

    def del_nodes(self, nodes: Iterable[str], live: Live) -> None:
        """Delete those of ``nodes`` the daemon has, in order (a parent before its child)."""
        for node in nodes:
            if node in live.nodes:
                self._monitor.q("blockdev-del", {"node-name": node})
                del live.nodes[node]

    # -- chains ---------------------------------------------------------------------------------------

    def open_chain(self, served: Served, chain: Chain, live: Live) -> bool:
        """Open ``chain`` unless the daemon has it; returns whether its size changed (save it: a
        refresh compares it with the file's)."""
        if chain.top() in live.nodes:
            return False
        # Leftovers of an interrupted attempt (a raw node that has a parent, a copy's filter, stays).
        self.del_nodes(tuple(n for n in (chain.fair_node, chain.throttle_node) if n), live)
        if chain.raw_node not in live.nodes:
            self._open_format(served, chain, live)
        try:
            self._limits.open_throttles(served, chain, live)
        except QmpError:
            live.nodes = self._monitor.live_nodes()
            self.del_nodes(chain.nodes(), live)
            raise
        live.nodes = self._monitor.live_nodes()
        # The chain serves the size its node had when it was opened, for good.
        size = live.nodes.get(chain.raw_node)
        changed, chain.size = size != chain.size, size
        return changed

    def _open_format(self, served: Served, chain: Chain, live: Live) -> None:
        """The chain's file (or RBD) node and its format node."""
        self.del_nodes((chain.file_node,), live)  # the leftover of an interrupted attempt
        if not chain.read_only:
            self.tracking.drop(c.raw_node for c in served.chains if c.gen != chain.gen and c.raw_node in live.nodes)
        if served.rbd is not None:
            self._add_rbd_node(chain.file_node, served.rbd, read_only=chain.read_only, what=served.key)
        else:
            self.add_file_node(chain.file_node, served.path, read_only=chain.read_only, what=served.key)
        try:
            # The format node: raw, or qcow2 for an image of the command backend's qemu-img profile.
            self._monitor.q("blockdev-add", {"driver": served.format, "node-name": chain.raw_node,
                                             "file": chain.file_node, "read-only": chain.read_only,
                                             "discard": "unmap"})
        except QmpError:
            live.nodes[chain.file_node] = None
            self.del_nodes((chain.file_node,), live)
            raise
        live.nodes[chain.raw_node] = None

    def _top(self, served: Served, chain: Chain, live: Live) -> str:
        """The node exports of ``chain`` go on: the filter of the oldest copy that runs on it (copy
        filters stack below the first one), else the chain's top node."""
        for copy in served.copies:
            filter_node = copy_names(copy.id)[2]
            if copy.gen == chain.gen and filter_node in live.nodes:
                return filter_node
        return chain.top()

    def _in_use(self, served: Served, gen: int, live: Live) -> bool:
        return any(e.gen == gen for e in served.exports) or any(
            c.gen == gen and copy_names(c.id)[0] in live.jobs for c in served.copies) or any(
            v.gen == gen and not v.lost for v in served.views)

    def collect(self, served: Served, live: Live) -> bool:
        """Close the chains of ``served`` that no export and no copy job uses; forget the key once
        nothing of it is left. Returns whether the desired state changed."""
        changed = False
        for chain in list(served.chains):
            if not self._in_use(served, chain.gen, live):
                self.del_nodes(chain.nodes(), live)  # parents first: each holds the next
                served.chains.remove(chain)
                changed = True
        desired = self._book.desired()
        if not (served.chains or served.exports or served.copies or served.views) and desired.get(served.key) is served:
            del desired[served.key]
            group = group_id(served.key)
            if group in live.groups:
                self._monitor.q("object-del", {"id": group})
                live.groups.discard(group)
            changed = True
        return changed

    def copying(self, served: Served, live: Live) -> bool:
        """Whether a copy of the key runs now (its job is there and has not concluded), or a view of it is
        held (views.py): either sits in its newest chain, which a new chain would escape."""
        jobs = (live.jobs.get(copy_names(c.id)[0]) for c in served.copies)
        return any(job is not None and job.status != "concluded" for job in jobs) or any(
            not v.lost for v in served.views)

    # -- exports --------------------------------------------------------------------------------------

    def open_export(self, served: Served, exp: HostExport, live: Live, *, replace: bool = False) -> bool:
        """Add ``exp`` (and its chain) unless the daemon has it; returns whether a chain size changed.

        ``replace``: an export with this id that the daemon has is not ``exp`` (its name was lost
        with the state file), so it is replaced rather than trusted.
        """
        if exp.id in live.exports:
            if not replace and not live.exports[exp.id].get("shutting-down"):
                return False
            self.close_export(exp.id, live)
        chain = served.chain(exp.gen)
        if chain is None:
            raise DriverError(f"export {exp.id} names chain {exp.gen} of {served.key}, which is not in the state")
        changed = self.open_chain(served, chain, live)
        node = self._top(served, chain, live)
        self._monitor.q("block-export-add", {"type": "nbd", "id": exp.id, "node-name": node, "name": exp.name,
                                             "writable": not exp.read_only})
        live.exports[exp.id] = {"id": exp.id, "node-name": node}
        return changed

    def close_export(self, export_id: str, live: Live) -> None:
        qmp = self._monitor.client
        if qmp is None or export_id not in live.exports:
            return
        mark = qmp.event_mark()
        try:
            # hard: a client still connected (forced detach) is cut off instead of pinning it.
            self._monitor.q("block-export-del", {"id": export_id, "mode": "hard"})
        except QmpCommandError as exc:
            if "not found" not in exc.desc:  # raced with its own shutdown: fine
                raise
        try:
            qmp.wait_event("BLOCK_EXPORT_DELETED", lambda e: e.get("data", {}).get("id") == export_id,
                           since=mark, timeout=self._monitor.timeout)
        except QmpConnectionError:
            self._wait_export_gone(export_id)  # event lost (reconnect): the daemon's state decides
        del live.exports[export_id]

    def _wait_export_gone(self, export_id: str) -> None:
        timeout = self._monitor.timeout
        deadline = time.monotonic() + timeout
        while export_id in self._monitor.live_exports():
            if time.monotonic() >= deadline:
                raise DriverError(f"export {export_id} still shutting down after {timeout:g}s")
            time.sleep(0.05)

    def close_unknown(self, key: str, host: str, live: Live) -> None:
        """Close the exports of (key, host) that the daemon has and the state does not (lost with a
        state file), and the nodes only they used."""
        desired = self._book.desired()
        known = {e.id for s in desired.values() for e in s.exports}
        ours = {c.raw_node for s in desired.values() for c in s.chains}
        for export_id, info in sorted(live.exports.items()):
            if export_id in known or key_host(export_id) != (key, host):
                continue
            self.close_export(export_id, live)
            top = str(info.get("node-name", ""))
            in_use = any(e.get("node-name") == top for e in live.exports.values())
            if top[:4] in CHAIN_PREFIXES and "vbsr" + top[4:] not in ours and not in_use:
                self.del_nodes(tuple(prefix + top[4:] for prefix in CHAIN_PREFIXES), live)
