"""Where ``vbs up`` keeps volumes and snapshots besides its file pools: the snapshot store its storage agents
share (docs/snapshots.md) and the Ceph cluster of ``--backend rbd``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vbs.config import NO_SNAPSHOT_STORE
from vbs.errors import InvalidParameter
from vbs.rigs.ceph import EmbeddedCeph
from vbs.trust.fail_closed import harden

__all__ = ["snapshot_store_flags", "SnapshotStoreChoice", "choose_snapshot_store", "choose_archive_store",
           "RbdChoice", "embedded_ceph"]


def snapshot_store_flags(options: dict[str, Any], *, archive: bool = False) -> list[str]:
    """A storage agent's flags for the snapshot store ``options`` (``config.parse_snapshot_store``'s table);
    with ``archive``, for the archive store."""
    driver = options["driver"]
    flag, s3 = ("--archive-store", "--archive-s3") if archive else ("--snapshot-store", "--s3")
    if driver == "dir":
        return [flag, f"dir:{options['path']}"]
    if driver == "s3":
        flags = [flag, f"s3://{options['bucket']}/{options.get('prefix', '')}"]
        if options.get("endpoint_url"):
            flags += [f"{s3}-endpoint", str(options["endpoint_url"])]
        if options.get("credentials_file"):
            flags += [f"{s3}-credentials-file", str(options["credentials_file"])]
        return flags
    return [] if archive else [flag, NO_SNAPSHOT_STORE]


@dataclass(frozen=True)
class SnapshotStoreChoice:
    """Where the storage agents of ``vbs up`` put snapshots (all of them the same store, so a volume may be
    restored on any of them), what the banner says of it."""

    options: dict[str, Any]
    where: str | None  # the store's own description (None: no store)
    note: str = ""  # what it does not protect against

    @property
    def flags(self) -> list[str]:
        return snapshot_store_flags(self.options)


def _same_filesystem(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` (or their nearest existing parents) are on one file system."""
    def device(p: Path) -> int:
        while not p.exists() and p != p.parent:
            p = p.parent
        return p.stat().st_dev
    return device(a) == device(b)


def choose_snapshot_store(data_dir: Path, options: dict[str, Any] | None, pools: list[Path]) -> SnapshotStoreChoice:
    """The store ``options`` name (default: a ``dir`` store in ``<data-dir>/snapshots``), set up now so a
    wrong setting stops ``vbs up`` before anything starts; the banner's words for it. ``pools``: where
    the volumes' data lives on this machine (the pools' directories, or the embedded Ceph's)."""
    from vbs import drivers

    options = dict(options or {"driver": "dir", "path": str(data_dir / "snapshots")})
    if options["driver"] == NO_SNAPSHOT_STORE:
        return SnapshotStoreChoice(options, None, "snapshots stay in their pools only")
    if options["driver"] == "dir":
        harden(Path(options["path"]))  # 0700, its files 0600: it holds every tenant's data
    store_cls: Any = drivers.load("snapshot_store", options["driver"])
    settings = {k: v for k, v in options.items() if k != "driver"}
    store = store_cls.from_config(settings, default_dir=data_dir / "snapshots")
    note = ""
    if options["driver"] == "dir" and any(_same_filesystem(Path(options["path"]), p) for p in pools):
        note = ("it is on the pool's own file system: it protects against a lost pool directory only, not a "
                "lost disk (give --snapshot-store dir:PATH on another disk, or s3://BUCKET/PREFIX)")
    return SnapshotStoreChoice(options, store.describe(), note)


def choose_archive_store(data_dir: Path, options: dict[str, Any] | None, store: SnapshotStoreChoice) -> list[str]:
    """The storage agents' flags of the archive store ``options`` name (None: none), set up now so a wrong
    setting stops ``vbs up`` before anything starts."""
    from vbs import drivers

    if options is None or options["driver"] == NO_SNAPSHOT_STORE:
        return []
    if store.where is None:
        raise InvalidParameter("--archive-store needs a snapshot store: snapshots are archived from it")
    if options["driver"] == "dir":
        harden(Path(options["path"]))
    store_cls: Any = drivers.load("snapshot_store", options["driver"])
    archive = store_cls.from_config({k: v for k, v in options.items() if k != "driver"},
                                    default_dir=data_dir / "archive")
    if archive.describe() == store.where:
        raise InvalidParameter("--archive-store is the snapshot store: give it another directory or bucket")
    return snapshot_store_flags(options, archive=True)


@dataclass(frozen=True)
class RbdChoice:
    """``vbs up --backend rbd``: the Ceph cluster the storage agents use (``conf`` None: the data
    dir's own single-node cluster, started and stopped with the services), its cephx user and pool."""

    conf: Path | None = None
    user: str = "admin"
    pool: str = "vbs"

    def agent_flags(self) -> list[str]:
        assert self.conf is not None
        return ["--backend", "rbd", "--ceph-conf", str(self.conf), "--ceph-user", self.user, "--rbd-pool", self.pool]


def embedded_ceph(data_dir: Path, pool: str) -> EmbeddedCeph:
    """The data dir's own single-node Ceph (made the first time, restarted on its data after), with
    ``pool``, every PG active+clean."""
    cluster = EmbeddedCeph(data_dir)
    print(f"vbs up: starting the single-node Ceph cluster in {cluster.root} ...", flush=True)
    cluster.start()
    try:
        cluster.create_pool(pool)
    except BaseException:
        cluster.stop()
        raise
    return cluster
