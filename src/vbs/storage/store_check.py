"""The storage agent's check of its snapshot store (``vbs check``; docs/snapshots.md): the snapshots the
controller says are stored there, each manifest read and each chunk it lists found; a deep check fetches
every chunk and hashes it again under its tenant's key, as a restore would."""

from __future__ import annotations

from vbs.errors import DriverError, InvalidParameter
from vbs.snapshot_store import StoreKey, check_store
from vbs.snapshot_store.contract import SnapshotStore
from vbs.wire.storage import CheckStore, StoreCheckReport, StoreProblem

__all__ = ["check_snapshots"]


def check_snapshots(store: SnapshotStore | None, location: str | None, req: CheckStore,
                    what: str = "snapshot") -> StoreCheckReport:
    """Check ``req.snapshot_ids`` in ``store`` (``location``: how the pools report it; ``what``: ``snapshot``
    or ``archive``, the store it is)."""
    if store is None:
        raise DriverError(f"this storage agent has no {what} store ([storage_agent.{what}_store] driver "
                          "= \"none\")")
    if req.deep and req.store_key is None:
        raise InvalidParameter("a deep check of the snapshot store needs the store key")
    key = StoreKey(bytes.fromhex(req.store_key.get_secret_value())) if req.store_key is not None else None
    report = check_store(store, snapshots=req.snapshot_ids, deep=req.deep,
                         tenant_keys=key.tenant_key if key is not None else None)
    return StoreCheckReport(
        store=location or store.describe(), snapshots=report.snapshots, chunks_checked=report.chunks_checked,
        bytes_checked=report.bytes_checked,
        problems=[StoreProblem(snapshot_id=p.snapshot_id, kind=p.kind, detail=p.detail[:1024], chunk_id=p.chunk_id,
                               chunk_index=p.chunk_index) for p in report.problems])
