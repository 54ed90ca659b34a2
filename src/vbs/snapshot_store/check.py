"""Check a store: every manifest readable and every chunk it lists present; ``deep``: every chunk
fetched, decompressed and hashed again under its tenant's key (what a restore would find)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from vbs.errors import InvalidParameter, SnapshotDataError
from vbs.snapshot_store.contract import ObjectMissing, SnapshotStore
from vbs.snapshot_store.format import Manifest, chunk_key, decode_chunk, key_id
from vbs.snapshot_store.manifests import load_manifest, snapshot_ids
from vbs.snapshot_store.parallel import bounded_map

__all__ = ["Problem", "CheckReport", "check_store"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong: a manifest that cannot be read, or a chunk of a snapshot missing or corrupt."""

    snapshot_id: str
    kind: Literal["manifest", "missing", "corrupt", "key"]
    detail: str
    chunk_id: str | None = None
    chunk_index: int | None = None

    def __str__(self) -> str:
        where = f"chunk {self.chunk_id} (index {self.chunk_index}) of " if self.chunk_id else ""
        return f"{where}{self.snapshot_id}: {self.kind}: {self.detail}"


@dataclass
class CheckReport:
    snapshots: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_store(store: SnapshotStore, *, snapshots: Iterable[str] | None = None, deep: bool = False,
                tenant_keys: Callable[[str], bytes] | None = None, parallel: int = 8) -> CheckReport:
    """Check ``snapshots`` (default: every manifest in the store). ``deep`` needs ``tenant_keys``
    (a tenant's key by its name, e.g. ``StoreKey.tenant_key``). A chunk shared by several snapshots
    is checked once and its problem reported for each of them."""
    if deep and tenant_keys is None:
        raise InvalidParameter("a deep check needs the tenants' keys")
    report = CheckReport()
    manifests: list[Manifest] = []
    for snapshot_id in snapshots if snapshots is not None else snapshot_ids(store):
        try:
            manifests.append(load_manifest(store, snapshot_id))
        except SnapshotDataError as exc:
            report.problems.append(Problem(snapshot_id, "manifest", exc.message))
        report.snapshots += 1

    # One check per (key, chunk id, length): the same id under two tenants' keys is two chunks.
    work: dict[tuple[str, str, int], list[tuple[Manifest, int]]] = {}
    keys: dict[str, bytes] = {}
    for manifest in manifests:
        if deep and tenant_keys is not None:
            tenant_key = keys.setdefault(manifest.tenant, tenant_keys(manifest.tenant))
            if key_id(tenant_key) != manifest.key_id:
                report.problems.append(Problem(manifest.snapshot_id, "key", f"stored under key {manifest.key_id}, "
                                               f"tenant {manifest.tenant}'s key is {key_id(tenant_key)}"))
                continue
        for index, cid in manifest.chunks.items():
            work.setdefault((manifest.tenant, cid, manifest.chunk_length(index)), []).append((manifest, index))

    def verify(item: tuple[str, str, int]) -> tuple[tuple[str, str, int], str | None, str, int]:
        tenant, cid, length = item
        if not deep:
            return item, None if store.has(chunk_key(cid)) else "missing", "not in the store", 0
        try:
            blob = store.get(chunk_key(cid))
        except ObjectMissing:
            return item, "missing", "not in the store", 0
        try:
            decode_chunk(blob, keys[tenant], cid, length=length)
        except ValueError as exc:
            return item, "corrupt", str(exc), len(blob)
        return item, None, "", len(blob)

    for item, kind, detail, size in bounded_map(verify, work, parallel):
        report.chunks_checked += 1
        report.bytes_checked += size
        if kind is not None:
            for manifest, index in work[item]:
                report.problems.append(Problem(manifest.snapshot_id, "missing" if kind == "missing" else "corrupt",
                                               detail, item[1], index))
    report.problems.sort(key=lambda p: (p.snapshot_id, p.chunk_index or -1))
    return report
