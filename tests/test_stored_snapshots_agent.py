"""The storage agent's side of the snapshot store, on a real file pool and a real store (unit tier): an
upload of a pool snapshot (incremental, repeatable, resumed by another agent), a copy pool giving its
full copy up once stored, restores checked chunk by chunk, a store that is down, the wrong key.

The whole path through ``vbs up`` (controller workflows, describe, placement) is test_snapshot_store_e2e.py.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.fakes import MemoryExports
from tests.snapshot_stores import flip_last_byte, until
from vbs import ids
from vbs.errors import DriverError, PointInTimeUnavailable, RetryLater, SnapshotStoreUnavailable
from vbs.snapshot_store import StoreKey, upload_snapshot
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.format import BLOCK_SIZE, CHUNK_SIZE, chunk_key
from vbs.snapshot_store.manifests import find_manifest
from vbs.snapshot_store.s3 import S3Store
from vbs.storage.backends.file import FileBackend
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.wire.connection import HostIdentity
from vbs.wire.storage import RestoreVolume, StoreSnapshot

pytestmark = pytest.mark.unit

MiB = 1 << 20
KEY = SecretStr(secrets.token_hex(32))


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[FileBackend]:
    (tmp_path / "pool").mkdir()
    backend = FileBackend("p", tmp_path / "pool", clone_method="copy", copy_chunk_bytes=MiB)
    yield backend
    backend.close()


@pytest.fixture
def store(tmp_path: Path) -> DirStore:
    return DirStore(tmp_path / "store")


def volume(pool: FileBackend, data: bytes) -> str:
    vol = ids.new_id("volume")
    pool.ensure_volume(vol, 8 * MiB)
    with open(pool.volume_path(vol), "r+b") as f:
        f.write(data)
    return vol


def snapshot(pool: FileBackend, vol: str) -> str:
    snap = ids.new_id("snapshot")
    assert until(lambda: pool.ensure_snapshot(snap, vol)).state == "ready"
    return snap


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_snapshot_is_stored_incrementally_and_a_copy_pool_gives_its_copy_up(pool: FileBackend,
                                                                                store: DirStore) -> None:
    agent = StoredSnapshots(store)
    data = os.urandom(3 * CHUNK_SIZE) + bytes(CHUNK_SIZE) + os.urandom(CHUNK_SIZE)  # 4 non-zero chunks, then zeros
    vol = volume(pool, data)
    first = snapshot(pool, vol)
    image_digest = digest(pool.snapshot_image(first))
    req = StoreSnapshot(volume_id=vol, tenant="acme", store_key=KEY)
    done = until(lambda: agent.upload(pool, "p", first, req))
    assert done.state == "ready" and done.chunks == 4 and done.chunks_uploaded == 4 and not done.pool_copy
    assert done.stored_bytes == 4 * CHUNK_SIZE and done.size_bytes == 8 * MiB and done.store == f"dir:{store.root}"
    assert find_manifest(store, first) is not None
    assert not (pool.path / "snapshots" / f"{first}.raw").exists(), "a copy pool keeps no full copy once stored"
    assert agent.upload(pool, "p", first, req) == done  # repeated: the same answer
    # Another agent (or this one restarted) answers from the manifest, and uploads nothing.
    again = StoredSnapshots(store).upload(pool, "p", first, req)
    assert again.state == "ready" and again.chunks == 4 and again.chunks_uploaded == 0
    # One chunk changed: the next snapshot sends that one only.
    with open(pool.volume_path(vol), "r+b") as f:
        f.seek(CHUNK_SIZE)
        f.write(os.urandom(CHUNK_SIZE))
    second = snapshot(pool, vol)
    incremental = StoreSnapshot(volume_id=vol, tenant="acme", parent_snapshot_id=first, store_key=KEY)
    after = until(lambda: agent.upload(pool, "p", second, incremental))
    assert after.state == "ready" and after.chunks == 4 and after.chunks_uploaded == 1
    assert len(list(store.list("chunks/"))) == 5
    # Restored anywhere: bit-exact, grown to the new size, the zeros left as holes.
    target = ids.new_id("volume")
    restore = RestoreVolume(snapshot_id=first, size_bytes=16 * MiB, tenant="acme", store_key=KEY)
    assert until(lambda: agent.restore(pool, "p", target, restore)).state == "ready"
    restored = pool.volume_path(target)
    assert restored.stat().st_size == 16 * MiB
    with open(restored, "rb") as f:
        assert hashlib.sha256(f.read(8 * MiB)).hexdigest() == image_digest
        assert f.read() == bytes(8 * MiB)


def test_a_snapshot_stored_with_1_mib_chunks_restores_and_the_next_upload_against_it_is_whole(
        pool: FileBackend, store: DirStore) -> None:
    """Manifests written before chunks became one 512 KiB block hold 1 MiB chunks: the agent restores
    them, and the next snapshot's upload, whose chunks cannot be compared with its parent's, reads and
    sends all of its own."""
    agent = StoredSnapshots(store)
    vol = volume(pool, os.urandom(3 * MiB))
    first = snapshot(pool, vol)
    first_digest = digest(pool.snapshot_image(first))
    old = upload_snapshot(store, pool.snapshot_image(first), 8 * MiB, snapshot_id=first, volume_id=vol,
                          tenant="acme", tenant_key=StoreKey(bytes.fromhex(KEY.get_secret_value())).tenant_key("acme"),
                          chunk_size=2 * BLOCK_SIZE)  # as an agent wrote it before
    assert old.manifest.chunk_size == 2 * BLOCK_SIZE and len(old.manifest.chunks) == 3
    assert until(lambda: agent.upload(pool, "p", first, StoreSnapshot(volume_id=vol, tenant="acme",
                                                                      store_key=KEY))).chunks == 3
    with open(pool.volume_path(vol), "r+b") as f:
        f.seek(MiB + 1)
        f.write(b"changed")
    second = snapshot(pool, vol)
    second_digest = digest(pool.snapshot_image(second))

    after = until(lambda: agent.upload(pool, "p", second, StoreSnapshot(
        volume_id=vol, tenant="acme", parent_snapshot_id=first, store_key=KEY)))

    every = 3 * MiB // CHUNK_SIZE  # 3 MiB of data
    assert after.state == "ready" and after.chunks == every and after.chunks_uploaded == every, after
    for snap, expected in ((first, first_digest), (second, second_digest)):
        target = ids.new_id("volume")
        restore = RestoreVolume(snapshot_id=snap, size_bytes=8 * MiB, tenant="acme", store_key=KEY)
        assert until(functools.partial(agent.restore, pool, "p", target, restore)).state == "ready"
        assert digest(pool.volume_path(target)) == expected


def test_a_reflink_pool_keeps_its_fast_tier(pool: FileBackend, store: DirStore) -> None:
    vol = volume(pool, os.urandom(MiB))
    snap = snapshot(pool, vol)
    pool.clone_method = "reflink"  # as a pool on xfs or btrfs says (the copy above is the same bytes)
    done = until(lambda: StoredSnapshots(store).upload(pool, "p", snap, StoreSnapshot(
        volume_id=vol, tenant="acme", store_key=KEY)))
    assert done.state == "ready" and done.pool_copy
    assert pool.snapshot_image(snap).exists()


def test_a_missing_or_corrupt_chunk_fails_the_restore_naming_it(pool: FileBackend, store: DirStore) -> None:
    agent = StoredSnapshots(store)
    vol = volume(pool, os.urandom(2 * MiB))
    snap = snapshot(pool, vol)
    until(lambda: agent.upload(pool, "p", snap, StoreSnapshot(volume_id=vol, tenant="acme", store_key=KEY)))
    manifest = find_manifest(store, snap)
    assert manifest is not None
    victim = manifest.chunks[1]
    path = store.root / chunk_key(victim)
    flip_last_byte(path)
    target = ids.new_id("volume")
    req = RestoreVolume(snapshot_id=snap, size_bytes=8 * MiB, tenant="acme", store_key=KEY)
    failed = until(lambda: agent.restore(pool, "p", target, req))
    assert failed.state == "error" and failed.error is not None
    assert victim in failed.error and snap in failed.error and "corrupt" in failed.error
    assert pool.inventory().volumes == [vol], "nothing half-written stays"
    path.unlink()
    missing = until(lambda: agent.restore(pool, "p", target, req))  # said once: this one starts over
    assert missing.state == "error" and missing.error is not None and victim in missing.error
    assert "missing" in missing.error


def test_another_store_key_is_refused(pool: FileBackend, store: DirStore) -> None:
    vol = volume(pool, os.urandom(MiB))
    snap = snapshot(pool, vol)
    until(lambda: StoredSnapshots(store).upload(pool, "p", snap, StoreSnapshot(volume_id=vol, tenant="a",
                                                                               store_key=KEY)))
    other = StoredSnapshots(store)
    with pytest.raises(DriverError, match="another store key"):
        other.restore(pool, "p", ids.new_id("volume"), RestoreVolume(
            snapshot_id=snap, size_bytes=8 * MiB, tenant="a", store_key=SecretStr(secrets.token_hex(32))))


def test_a_store_that_is_down_says_so_to_retry_later(pool: FileBackend, tmp_path: Path) -> None:
    from vbs.net.ports import free_port

    creds = tmp_path / "s3-credentials"
    creds.write_text("[default]\naws_access_key_id = AKIAVBSTEST\naws_secret_access_key = not-a-secret\n")
    creds.chmod(0o600)
    down = S3Store.from_config({"bucket": "vbs-down", "endpoint_url": f"http://127.0.0.1:{free_port()}",
                                "region": "us-east-1", "max_attempts": 1, "connect_timeout_s": 1,
                                "credentials_file": str(creds)}, default_dir=tmp_path)
    vol = volume(pool, os.urandom(MiB))
    snap = snapshot(pool, vol)
    with pytest.raises(SnapshotStoreUnavailable):
        StoredSnapshots(down).upload(pool, "p", snap, StoreSnapshot(volume_id=vol, tenant="a", store_key=KEY))
    assert pool.snapshot_image(snap).exists(), "the pool copy stays until the store has it"


def test_deleting_a_stored_snapshot_leaves_the_others(pool: FileBackend, store: DirStore) -> None:
    agent = StoredSnapshots(store)
    vol = volume(pool, os.urandom(MiB))
    kept, gone = snapshot(pool, vol), snapshot(pool, vol)
    for snap in (kept, gone):
        until(lambda snap=snap: agent.upload(pool, "p", snap, StoreSnapshot(volume_id=vol, tenant="a",
                                                                             store_key=KEY)))
    agent.delete(gone)
    agent.delete(gone)  # idempotent
    assert find_manifest(store, gone) is None and find_manifest(store, kept) is not None
    assert agent.status(pool, "p", gone).state == "absent"
    assert agent.status(pool, "p", kept).state == "ready"


def test_the_holes_of_a_snapshot_image_are_not_read(tmp_path: Path) -> None:
    from vbs.snapshot_store.volume_io import FileReader
    from vbs.storage.stored_snapshots import _SparseReader

    image = tmp_path / "image.raw"
    with image.open("wb") as f:
        f.truncate(64 * MiB)
        f.seek(5 * MiB + 4096)
        f.write(b"data")
    reads: list[int] = []

    class Counting(FileReader):
        def read_at(self, offset: int, length: int) -> bytes:
            reads.append(offset)
            return super().read_at(offset, length)

    with Counting(image) as reader:
        sparse = _SparseReader(reader, 64 * MiB)
        got = [sparse.read_at(i * MiB, MiB) for i in range(64)]
    assert reads == [5 * MiB], "only the chunk with data is read"
    assert got[5][4096:4100] == b"data" and all(c == bytes(MiB) for i, c in enumerate(got) if i != 5)


def test_a_copy_pool_with_no_daemon_view_reads_a_detached_volume_in_place(tmp_path: Path, store: DirStore) -> None:
    """No full copy: the snapshot holds the volume (no export of it is made) until it is stored, also
    across an agent restart; a volume a host writes to is the hypervisor's to copy."""
    (tmp_path / "held").mkdir()
    exports = MemoryExports()  # an export driver with no point-in-time view (as tgt)

    def open_pool() -> FileBackend:
        return FileBackend("p", tmp_path / "held", exports=exports, clone_method="copy", stream_snapshots=True)

    pool = open_pool()
    data = os.urandom(2 * MiB) + bytes(5 * MiB) + os.urandom(MiB)
    vol = volume(pool, data)
    snap = ids.new_id("snapshot")
    assert pool.ensure_snapshot(snap, vol).state == "ready", "nothing to copy: ready at once"
    snapshots = tmp_path / "held" / "snapshots"
    assert [p.name for p in snapshots.iterdir()] == [f"{snap}.hold"], "no copy, only the hold"
    assert (snapshots / f"{snap}.hold").stat().st_mode & 0o777 == 0o600
    assert pool.snapshot_image(snap) == pool.volume_path(vol)
    host = HostIdentity(name="hv-a", address="127.0.0.1")
    with pytest.raises(RetryLater, match=snap):
        pool.connection_for(vol, host)
    pool.close()

    pool = open_pool()  # the agent restarted: the hold stands
    assert pool.snapshot_status(snap).state == "ready"
    with pytest.raises(RetryLater):
        pool.connection_for(vol, host)
    done = until(lambda: StoredSnapshots(store).upload(pool, "p", snap, StoreSnapshot(
        volume_id=vol, tenant="acme", store_key=KEY)))
    assert done.state == "ready" and done.chunks == 3 * MiB // CHUNK_SIZE and not done.pool_copy  # 3 MiB of data
    assert list(snapshots.iterdir()) == [], "stored: the hold is gone"
    target = ids.new_id("volume")
    restore = RestoreVolume(snapshot_id=snap, size_bytes=8 * MiB, tenant="acme", store_key=KEY)
    assert until(lambda: StoredSnapshots(store).restore(pool, "p", target, restore)).state == "ready"
    assert pool.volume_path(target).read_bytes() == data
    pool.connection_for(vol, host)  # exports are made again

    with pytest.raises(PointInTimeUnavailable):  # exported: its hypervisor copies it (a snapshot target)
        pool.ensure_snapshot(ids.new_id("snapshot"), vol)
    pool.remove_connection(vol, host.name)
    other = ids.new_id("snapshot")
    assert pool.ensure_snapshot(other, vol).state == "ready"
    pool.remove_snapshot(other)  # deleted before it was stored: the hold goes
    assert list(snapshots.iterdir()) == []
    pool.connection_for(vol, host)
    pool.close()
