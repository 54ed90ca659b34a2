"""The ``command`` backend: a pool whose every change is a command of a profile (the paper's (docs/architecture.md §1)
``lvcreate``, ``lvcreate -s``, ``lvremove``, ``dd`` kept in a property file), typed and checked.

A profile (kind ``backend``; shipped: ``qemu-img``, ``lvm``) says how a volume and a snapshot are
made, copied, grown and removed, where their data is (``volume_path`` and ``snapshot_path``,
templates of the pool's directory or volume group and the id) and in which format the export
daemon opens it (``raw``, or ``qcow2``: NBD only). VBS keeps what makes it safe:

- every call is idempotent: an item whose path exists is there; nothing else is;
- on a pool of files (``publish = "rename"``), a command writes to ``<path>.partial`` and the item
  appears only when that is renamed into place, so a command a crash interrupted leaves a partial
  file, which the next ``ensure`` removes and starts again (the source of a clone or a snapshot does
  not change while it is made: a snapshot of a volume a host writes to is taken by the hypervisor);
- a snapshot that a clone's image depends on (a qcow2 backing file) stays on disk, hidden, until
  its last clone is gone (``remove_snapshot`` then only marks it removed);
- the pool serves hosts through its export driver, like the ``file`` backend.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from vbs import ids
from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound, PointInTimeUnavailable
from vbs.pools.exports import ExportDriver, FileSource
from vbs.profiles import CommandSchema, Profile, ProfileSchema, load_profile
from vbs.system.files import write_private
from vbs.wire.connection import Connection, HostIdentity
from vbs.wire.storage import ExportInfo, ItemStatus, PoolInfo, PoolInventory

__all__ = ["CommandBackend", "BACKEND_PROFILES"]

log = logging.getLogger(__name__)

_VOL = frozenset({"volume", "path", "pool_path", "size_bytes", "size_mib", "size_gib", "format"})
_SNAP = frozenset({"snapshot", "snapshot_path", "volume", "path", "pool_path", "format"})
_TEMPLATE = r"[A-Za-z0-9_./{}-]{1,255}"

BACKEND_PROFILES = ProfileSchema(
    kind="backend",
    commands={
        "create": CommandSchema(_VOL, description="make an empty volume of size_bytes at path"),
        "remove_volume": CommandSchema(_VOL - {"size_bytes", "size_mib", "size_gib"}, description="remove the volume"),
        "snapshot": CommandSchema(_SNAP, description="copy the volume at path into snapshot_path"),
        "remove_snapshot": CommandSchema(_SNAP - {"volume", "path"}, description="remove the snapshot"),
        "clone": CommandSchema(_VOL | {"source_snapshot", "snapshot_path"},
                               description="make a volume at path from the snapshot at snapshot_path"),
        "resize": CommandSchema(_VOL, description="grow the volume at path to size_bytes"),
        "size": CommandSchema(frozenset({"path", "pool_path", "format"}), required=False,
                              description="print the virtual size of the item at path: `lines` picks "
                                          "(?P<size>[0-9]+)"),
    },
    options={
        "format": (r"raw|qcow2", "raw"),
        "volume_path": (_TEMPLATE, "{pool_path}/volumes/{volume}.img"),
        "snapshot_path": (_TEMPLATE, "{pool_path}/snapshots/{snapshot}.img"),
        # rename: commands write <path>.partial, renamed into place (files); direct: the command
        # makes the item at its path in one step (logical volumes).
        "publish": (r"rename|direct", "rename"),
        # whether clones depend on their snapshot's data (qcow2 backing files, LVM snapshots)
        "clones_depend": (r"yes|no", "no"),
    },
)
_MIB = 1 << 20


class CommandBackend:
    """One pool driven by a backend profile (see the module docstring)."""

    def __init__(self, name: str, pool_path: Path, profile: Profile, *, exports: ExportDriver | None = None) -> None:
        self.name = name
        self.pool_path = Path(pool_path)
        self.profile = profile
        self.exports = exports
        self.format = profile.options["format"]
        self.rename = profile.options["publish"] == "rename"
        self.clones_depend = profile.options["clones_depend"] == "yes"
        self._lock = threading.Lock()
        if self.rename:
            for sub in ("volumes", "snapshots"):
                (self.pool_path / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        # Which snapshot each clone depends on, and snapshots removed while clones still need them.
        self._deps_file = self.pool_path / ".vbs-clones.json"

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> CommandBackend:
        if not cfg.profile:
            raise InvalidParameter("the command backend needs a profile (profile = NAME or PATH)")
        profile = load_profile(BACKEND_PROFILES, cfg.profile, cfg.profile_dirs)
        return cls(cfg.pool_name, cfg.pool_path.resolve(), profile, exports=exports)

    # -- pool -------------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        st = os.statvfs(self.pool_path)
        return PoolInfo(name=self.name, backend="command", capacity_bytes=st.f_blocks * st.f_frsize,
                        free_bytes=st.f_bavail * st.f_frsize, clone_method="copy", point_in_time=False)

    def inventory(self) -> PoolInventory:
        found: dict[str, list[str]] = {"volume": [], "snapshot": []}
        removed = set(self._deps().removed)
        for kind in found:
            folder = self._path(kind, ids.new_id(kind)).parent
            if folder.is_dir():
                for entry in folder.iterdir():
                    item = self._id_of(kind, entry.name)
                    if item is not None and item not in removed:
                        found[kind].append(item)
        return PoolInventory(volumes=sorted(found["volume"]), snapshots=sorted(found["snapshot"]))

    def close(self) -> None:
        return None  # no background work: every command runs in its caller

    # -- volumes ----------------------------------------------------------------------------------

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        path = self._path("volume", volume_id)
        _check_size(size_bytes)
        with self._lock:
            if path.exists():
                return self._ready(path)
            values = self._values(volume=volume_id, size_bytes=size_bytes)
            if source_snapshot_id is None:
                self._make(path, "create", values)
            else:
                snap = self._path("snapshot", source_snapshot_id)
                if not snap.exists() or source_snapshot_id in self._deps().removed:
                    raise NotFound(f"The snapshot '{source_snapshot_id}' does not exist.",
                                   code="InvalidSnapshot.NotFound")
                values.update(source_snapshot=source_snapshot_id, snapshot_path=str(snap))
                self._make(path, "clone", values)
                if self.clones_depend:
                    self._record_clone(volume_id, source_snapshot_id)
                if self._size(path, volume_id) < size_bytes:
                    self.profile.run("resize", {**values, "path": str(path)})
            return self._ready(path)

    def volume_status(self, volume_id: str) -> ItemStatus:
        path = self._path("volume", volume_id)
        return self._ready(path) if path.exists() else ItemStatus(state="absent")

    def remove_volume(self, volume_id: str) -> None:
        path = self._path("volume", volume_id)
        with self._lock:
            if path.exists():
                self.profile.run("remove_volume", self._values(volume=volume_id))
            self._partial(path).unlink(missing_ok=True)
            self._forget_clone(volume_id)

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        path = self._path("volume", volume_id)
        _check_size(size_bytes)
        with self._lock:
            if not path.exists():
                raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")
            current = self._size(path, volume_id)
            if size_bytes < current:
                raise InvalidParameter(f"Volume {volume_id}: the new size {size_bytes} is smaller than the current "
                                       f"size {current}; volumes can only grow")
            if size_bytes > current:
                self.profile.run("resize", self._values(volume=volume_id, size_bytes=size_bytes))
            return self._ready(path)

    # -- snapshots --------------------------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        path = self._path("snapshot", snapshot_id)
        source = self._path("volume", volume_id)
        with self._lock:
            if path.exists():
                return self._ready(path)
            if not source.exists():
                raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")
            if self.exports is not None and self.exports.is_exported(volume_id):
                raise PointInTimeUnavailable(
                    f"The volume '{volume_id}' is exported to a host: its profile's snapshot command would copy it "
                    "while it changes; its hypervisor must take the copy.")
            self._make(path, "snapshot", self._values(snapshot=snapshot_id, volume=volume_id))
            return self._ready(path)

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        path = self._path("snapshot", snapshot_id)
        if path.exists() and snapshot_id not in self._deps().removed:
            return self._ready(path)
        return ItemStatus(state="absent")

    def remove_snapshot(self, snapshot_id: str) -> None:
        path = self._path("snapshot", snapshot_id)
        if self.exports is not None:
            for export in self.exports.list_exports():
                if export.key == snapshot_id:
                    self.exports.remove_export(snapshot_id, export.host)
        with self._lock:
            deps = self._deps()
            if snapshot_id in deps.clones.values():
                # Clones read through it: hidden now, removed with the last of them.
                if snapshot_id not in deps.removed:
                    deps.removed.append(snapshot_id)
                    deps.save(self._deps_file)
                return
            self._drop_snapshot(snapshot_id, path)

    def snapshot_target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        path = self._path("snapshot", snapshot_id)
        source = self._path("volume", volume_id)
        exports = self._need_exports()
        with self._lock:
            if path.exists():
                raise IncorrectState(f"The snapshot '{snapshot_id}' is complete already.")
            if not source.exists():
                raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")
            partial = self._partial(path)
            if not partial.exists():
                # An empty item of the volume's size, made by the profile, that the hypervisor fills.
                values = self._values(volume=volume_id, size_bytes=self._size(source, volume_id))
                self.profile.run("create", {**values, "path": str(partial)})
        return exports.ensure_export(snapshot_id, self._source(partial, snapshot_id), host, read_only=False)

    def finish_snapshot_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        path = self._path("snapshot", snapshot_id)
        self._need_exports().remove_export(snapshot_id, host_name)
        with self._lock:
            if not path.exists():
                partial = self._partial(path)
                if not partial.exists():
                    raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
                os.rename(partial, path)
                _fsync_dir(path.parent)
            return self._ready(path)

    # -- how hosts reach volumes ----------------------------------------------------------------------

    def connection_for(self, volume_id: str, host: HostIdentity, *, read_only: bool = False,
                       protocols: Collection[str] = ()) -> Connection:
        path = self._path("volume", volume_id)
        if not path.exists():
            raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")
        return self._need_exports().ensure_export(volume_id, self._source(path, volume_id), host, read_only=read_only)

    def remove_connection(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        self._need_exports().remove_export(volume_id, host_name)

    def refresh_connection(self, volume_id: str, host_name: str) -> Connection:
        path = self._path("volume", volume_id)
        return self._need_exports().refresh_export(volume_id, self._source(path, volume_id), host_name)

    def retire_connections(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        self._need_exports().retire_exports(volume_id, host_name)

    def native_connections(self) -> list[ExportInfo]:
        return []

    # -- inside -------------------------------------------------------------------------------------

    def _path(self, kind: str, item_id: str) -> Path:
        ids.check(kind, item_id)
        key = "volume_path" if kind == "volume" else "snapshot_path"
        rendered = self.profile.fill(self.profile.options[key], {kind: item_id, "pool_path": str(self.pool_path)})
        path = Path(rendered)
        if not path.is_absolute():
            raise DriverError(f"profile {self.profile.name}: {key} must make an absolute path, not {rendered!r}")
        return path

    def _id_of(self, kind: str, name: str) -> str | None:
        template = Path(self.profile.options["volume_path" if kind == "volume" else "snapshot_path"]).name
        head, _, tail = template.partition("{" + kind + "}")
        if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
            item = name[len(head):len(name) - len(tail)]
            if ids.is_valid(kind, item):
                return item
        return None

    def _partial(self, path: Path) -> Path:
        return path.with_name(path.name + ".partial")

    def _values(self, **given: object) -> dict[str, object]:
        values: dict[str, object] = {"pool_path": str(self.pool_path), "format": self.format, **given}
        if "volume" in given:
            values["path"] = str(self._path("volume", str(given["volume"])))
        if "snapshot" in given:
            values["snapshot_path"] = str(self._path("snapshot", str(given["snapshot"])))
        if "size_bytes" in given:
            values["size_mib"] = -(-int(str(given["size_bytes"])) // _MIB)
            values["size_gib"] = -(-int(str(given["size_bytes"])) // (1024 * _MIB))
        return values

    def _make(self, path: Path, command: str, values: dict[str, object]) -> None:
        """Run ``command`` to make the item at ``path``; with ``publish = "rename"`` it writes a
        partial file that appears at ``path`` only once complete (a leftover partial is removed
        first: it is what an interrupted attempt left)."""
        key = "path" if command in ("create", "clone") else "snapshot_path"
        if not self.rename:
            self.profile.run(command, values)
            return
        partial = self._partial(path)
        partial.unlink(missing_ok=True)
        try:
            self.profile.run(command, {**values, key: str(partial)})
            os.rename(partial, path)
            _fsync_dir(path.parent)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    def _source(self, path: Path, key: str) -> FileSource:
        if self.format == "raw":
            return FileSource(path)
        return FileSource(path, self.format, self._size(path, key))

    def _size(self, path: Path, item: str) -> int:
        """The virtual size: the profile's ``size`` command, or the size of the file or device."""
        if self.profile.has("size"):
            out = self.profile.run("size", {"path": str(path), "pool_path": str(self.pool_path),
                                            "format": self.format})
            for found in out.matches(self.profile.commands["size"]):
                if re.fullmatch(r"[0-9]{1,20}", found.get("size", "")):
                    return int(found["size"])
            raise DriverError(f"profile {self.profile.name}: size printed no size for {path}")
        try:
            with open(path, "rb") as f:
                return f.seek(0, os.SEEK_END)
        except FileNotFoundError:
            raise NotFound(f"{item} does not exist", code="InvalidVolume.NotFound") from None

    def _ready(self, path: Path) -> ItemStatus:
        return ItemStatus(state="ready", size_bytes=self._size(path, str(path)), progress=1.0)

    def _need_exports(self) -> ExportDriver:
        if self.exports is None:
            raise DriverError(f"pool {self.name} serves no host (it has no export driver)")
        return self.exports

    def _drop_snapshot(self, snapshot_id: str, path: Path) -> None:
        if path.exists():
            self.profile.run("remove_snapshot", self._values(snapshot=snapshot_id))
        self._partial(path).unlink(missing_ok=True)

    # -- clones and the snapshots they depend on (a small 0600 file in the pool) ------------------

    def _deps(self) -> _Deps:
        return _Deps.load(self._deps_file)

    def _record_clone(self, volume_id: str, snapshot_id: str) -> None:
        deps = self._deps()
        deps.clones[volume_id] = snapshot_id
        deps.save(self._deps_file)

    def _forget_clone(self, volume_id: str) -> None:
        deps = self._deps()
        snapshot_id = deps.clones.pop(volume_id, None)
        if snapshot_id is None:
            return
        if snapshot_id in deps.removed and snapshot_id not in deps.clones.values():
            self._drop_snapshot(snapshot_id, self._path("snapshot", snapshot_id))
            deps.removed.remove(snapshot_id)
        deps.save(self._deps_file)


@dataclass
class _Deps:
    clones: dict[str, str]  # clone volume -> the snapshot its data depends on
    removed: list[str]  # snapshots removed while clones still depend on them (hidden)

    @classmethod
    def load(cls, path: Path) -> _Deps:
        """As ``save`` wrote them (none before the first clone)."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls({}, [])
        except ValueError as exc:
            raise DriverError(f"{path} is damaged: {exc}") from exc
        return cls(dict(data.get("clones", {})), list(data.get("removed", [])))

    def save(self, path: Path) -> None:
        write_private(path, json.dumps({"clones": self.clones, "removed": self.removed}, sort_keys=True) + "\n")


def _check_size(size_bytes: int) -> None:
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or not 0 < size_bytes <= 64 << 40:
        raise InvalidParameter(f"invalid size {size_bytes!r}")
    if size_bytes % 512:
        raise InvalidParameter(f"size {size_bytes} is not a multiple of 512 bytes")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
