"""The snapshot store: point-in-time images of volumes, kept outside the pool (docs/snapshots.md).

Content-addressed chunks (HMAC-SHA256 under a per-tenant key, zstd-compressed, zeros not stored)
and one self-contained manifest per snapshot, in a directory or an S3 bucket. The storage agent
reads and writes it; the controller only records which snapshot has a manifest::

    store = DirStore(Path("/srv/vbs/snapshots"))          # or drivers.load("snapshot_store", "s3")
    key = StoreKey.load_or_create(state_dir / KEY_FILE_NAME)
    open_store(store, key)                                # a store of this format and this key
    tenant_key = key.tenant_key("acme")
    done = upload_snapshot(store, "/pool/snap.raw", size, snapshot_id="snap-…", volume_id="vol-…",
                           tenant="acme", tenant_key=tenant_key, previous=last_manifest,
                           changed_blocks=ranges_of_extents(diff))
    restore_snapshot(store, done.manifest, "/pool/new.raw", tenant_key=tenant_key)
    delete_snapshot(store, "snap-…")                      # its manifest; chunks go with the next GC
    collect_garbage(store)                                # unreferenced chunks past the grace period
    check_store(store, deep=True, tenant_keys=key.tenant_key)
"""

from vbs.snapshot_store.blocks import (
    BlockRange,
    BlockRef,
    block_ref,
    changed_blocks,
    manifest_blocks,
    ranges_of_extents,
)
from vbs.snapshot_store.check import CheckReport, Problem, check_store
from vbs.snapshot_store.contract import ObjectInfo, ObjectMissing, SnapshotStore
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.format import BLOCK_SIZE, CHUNK_SIZE, FORMAT_VERSION, Manifest
from vbs.snapshot_store.gc import GcReport, collect_garbage
from vbs.snapshot_store.keys import KEY_FILE_NAME, StoreKey, open_store
from vbs.snapshot_store.manifests import delete_snapshot, find_manifest, load_manifest, snapshot_ids
from vbs.snapshot_store.restore import RestoreResult, fetch_chunk, restore_snapshot
from vbs.snapshot_store.upload import UploadResult, upload_snapshot
from vbs.snapshot_store.volume_io import FileReader, FileWriter, VolumeReader, VolumeWriter

__all__ = [
    "SnapshotStore", "DirStore", "upload_snapshot", "restore_snapshot", "collect_garbage", "check_store",
    "delete_snapshot", "load_manifest", "find_manifest", "snapshot_ids", "fetch_chunk", "StoreKey", "open_store",
    "KEY_FILE_NAME", "Manifest", "UploadResult", "RestoreResult", "GcReport", "CheckReport", "Problem",
    "BlockRange", "BlockRef", "manifest_blocks", "block_ref", "changed_blocks", "ranges_of_extents", "ObjectInfo",
    "ObjectMissing", "VolumeReader", "VolumeWriter", "FileReader", "FileWriter", "BLOCK_SIZE", "CHUNK_SIZE",
    "FORMAT_VERSION",
]
