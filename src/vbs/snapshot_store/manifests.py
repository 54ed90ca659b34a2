"""Manifests and upload markers in a store: load, save, list, delete.

Deleting a snapshot deletes its manifest (and marks abandoned a marker an unfinished upload left): nothing else.
Its chunks stay until garbage collection finds no manifest that lists them (``gc.collect_garbage``),
so deleting one snapshot never touches another's data.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TypeVar

from vbs import ids
from vbs.errors import NotFound, SnapshotDataError
from vbs.snapshot_store.contract import ObjectMissing, SnapshotStore
from vbs.snapshot_store.format import (
    MANIFESTS,
    UPLOADS,
    Manifest,
    UploadMarker,
    decode_manifest,
    decode_marker,
    encode_manifest,
    encode_marker,
    manifest_key,
    marker_key,
)
from vbs.snapshot_store.gc_runs import CLOCK_SKEW_S

__all__ = ["load_manifest", "find_manifest", "save_manifest", "snapshot_ids", "delete_snapshot", "load_marker",
           "save_marker", "markers", "trust_before"]


_T = TypeVar("_T")


def _find(store: SnapshotStore, key: str, snapshot_id: str, decode: Callable[[bytes, str], _T]) -> _T | None:
    """The object at ``key`` decoded, or None if the store has none (a damaged one raises)."""
    try:
        blob = store.get(key)
    except ObjectMissing:
        return None
    return decode(blob, snapshot_id)


def find_manifest(store: SnapshotStore, snapshot_id: str) -> Manifest | None:
    """The manifest of ``snapshot_id``, or None if the store has none (a damaged one raises)."""
    return _find(store, manifest_key(snapshot_id), snapshot_id, decode_manifest)


def load_manifest(store: SnapshotStore, snapshot_id: str) -> Manifest:
    manifest = find_manifest(store, snapshot_id)
    if manifest is None:
        raise NotFound(f"the snapshot store {store.describe()} has no manifest of {snapshot_id}",
                       code="InvalidSnapshot.NotFound", snapshot_id=snapshot_id)
    return manifest


def save_manifest(store: SnapshotStore, manifest: Manifest) -> None:
    store.put(manifest_key(manifest.snapshot_id), encode_manifest(manifest))


def snapshot_ids(store: SnapshotStore) -> list[str]:
    """Every snapshot the store holds a manifest of."""
    found = (info.key[len(MANIFESTS):] for info in store.list(MANIFESTS))
    return sorted(s for s in found if ids.is_valid("snapshot", s))


def delete_snapshot(store: SnapshotStore, snapshot_id: str, *, now: Callable[[], float] = time.time) -> None:
    """Forget ``snapshot_id``: its manifest and its upload marker. Idempotent. The marker of an upload
    that never wrote its manifest stays, abandoned and claiming nothing, until a collection has swept
    the chunks that upload may have left unsynced (docs/snapshots.md, "Durability")."""
    finished = store.has(manifest_key(snapshot_id))
    store.delete(manifest_key(snapshot_id))
    try:
        marker = load_marker(store, snapshot_id)
    except SnapshotDataError:
        marker = None  # damaged: when its upload began is lost with it
    if marker is None or finished:
        store.delete(marker_key(snapshot_id))
    elif marker.abandoned_at is None:
        save_marker(store, dataclasses.replace(marker, claims=frozenset(),
                                               abandoned_at=datetime.fromtimestamp(now(), UTC)))


def load_marker(store: SnapshotStore, snapshot_id: str) -> UploadMarker | None:
    return _find(store, marker_key(snapshot_id), snapshot_id, decode_marker)


def save_marker(store: SnapshotStore, marker: UploadMarker) -> None:
    store.put(marker_key(marker.snapshot_id), encode_marker(marker))


def markers(store: SnapshotStore) -> Iterator[UploadMarker]:
    """Every upload marker in the store (a marker deleted while listed is skipped)."""
    for info in store.list(UPLOADS):
        snapshot_id = info.key[len(UPLOADS):]
        if not ids.is_valid("snapshot", snapshot_id):
            continue
        marker = load_marker(store, snapshot_id)
        if marker is not None:
            yield marker


def trust_before(store: SnapshotStore, started: float) -> float:
    """Before when a chunk in the store was put for certain by a writer that has committed: before this
    writer (an upload, or a copy between stores) and every upload still in flight (a marker) began, less
    the clocks' skew (docs/snapshots.md, "Durability"). A damaged marker hides when its upload began: then
    no chunk is trusted."""
    oldest = started
    try:
        for marker in markers(store):
            oldest = min(oldest, marker.started_at.timestamp())
    except SnapshotDataError:
        return 0.0
    return oldest - CLOCK_SKEW_S
