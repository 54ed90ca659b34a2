"""RBD snapshots in the snapshot store, at the storage agent (docs/snapshots.md "RBD pools"): a real
single-node Ceph, the rbd backend, a file pool beside it and a ``dir`` store.

An RBD snapshot is uploaded and stays in the pool (its fast tier); the next one reads only the objects
``rbd diff`` reports changed and sends the chunks that changed; a snapshot restores bit for bit from the
store RBD→file and file→RBD; a corrupt chunk fails a restore onto RBD naming it, and no image is left.
Data is written into the images with ``qemu-io`` (QEMU's librbd), read back with ``rbd export``.
The whole path through the controller is tests/test_rbd_snapshot_store_e2e.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.ceph_cluster import CephForTests
from tests.rbd_cloud import rbd_export_sha256, rbd_json
from tests.snapshot_stores import flip_last_byte, sha, until
from vbs import ids
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.format import CHUNK_SIZE, chunk_key
from vbs.snapshot_store.manifests import find_manifest
from vbs.storage.backends.file import FileBackend
from vbs.storage.backends.rbd import RbdBackend
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.wire.storage import RestoreVolume, StoreSnapshot

pytestmark = pytest.mark.integration

MiB = 1 << 20
SIZE = 64 * MiB
OBJECT = 4 * MiB  # an RBD object, as VBS makes images (rbd's default)
KEY = SecretStr(secrets.token_hex(32))


class Pools:
    def __init__(self, ceph: CephForTests, tmp: Path) -> None:
        self.conf = ceph.conf_path
        self.rbd_pool = ceph.new_pool()
        self.rbd = RbdBackend("r", self.conf, rbd_pool=self.rbd_pool)
        (tmp / "files").mkdir()
        self.files = FileBackend("f", tmp / "files", clone_method="copy", copy_chunk_bytes=MiB)
        self.store = DirStore(tmp / "store")
        self.agent = StoredSnapshots(self.store)

    def write(self, volume_id: str, offset: int, data: bytes, tmp: Path) -> None:
        """``data`` written into the volume's image at ``offset`` by QEMU's librbd."""
        src = tmp / "data.bin"
        src.write_bytes(data)
        proc = subprocess.run(["qemu-io", "-f", "raw", f"rbd:{self.rbd_pool}/{volume_id}:conf={self.conf}",
                               "-c", f"write -s {src} {offset} {len(data)}"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stdout + proc.stderr

    def export_sha(self, spec: str, mib: int = SIZE // MiB) -> str:
        return rbd_export_sha256(self.conf, f"{self.rbd_pool}/{spec}", mib)

    def images(self) -> list[str]:
        return sorted(rbd_json(self.conf, "ls", self.rbd_pool))

    def close(self) -> None:
        self.agent.close()
        self.rbd.close()
        self.files.close()


@pytest.fixture
def pools(ceph: CephForTests, tmp_path: Path) -> Iterator[Pools]:
    p = Pools(ceph, tmp_path)
    yield p
    p.close()


def test_an_rbd_snapshot_is_stored_incrementally_and_restored_onto_a_file_pool(
        pools: Pools, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbs.storage.stored_snapshots")
    vol = ids.new_id("volume")
    pools.rbd.ensure_volume(vol, SIZE)
    pools.write(vol, 0, os.urandom(8 * MiB), tmp_path)
    pools.write(vol, 40 * MiB, os.urandom(MiB), tmp_path)
    first = ids.new_id("snapshot")
    assert pools.rbd.ensure_snapshot(first, vol).state == "ready"

    req = StoreSnapshot(volume_id=vol, tenant="acme", store_key=KEY)
    done = until(lambda: pools.agent.upload(pools.rbd, "r", first, req))
    stored = 9 * MiB // CHUNK_SIZE  # 9 MiB of data, every chunk its own
    assert done.state == "ready" and done.chunks == stored and done.chunks_uploaded == stored, done
    assert done.pool_copy and done.size_bytes == SIZE and done.stored_bytes == 9 * MiB
    assert find_manifest(pools.store, first) is not None
    assert pools.rbd.snapshot_status(first).state == "ready", "the RBD snapshot stays: the fast tier"
    assert pools.agent.pool_info(pools.rbd).snapshot_store == f"dir:{pools.store.root}"

    # One MiB changed: rbd diff reports its one 4 MiB object, whose chunks are all read; those of the MiB
    # written are sent (with 512 KiB chunks: 8 read, 2 sent).
    pools.write(vol, 2 * MiB, os.urandom(MiB), tmp_path)
    second = ids.new_id("snapshot")
    pools.rbd.ensure_snapshot(second, vol)
    diff = rbd_json(pools.conf, "diff", "--from-snap", first, "--whole-object", f"{pools.rbd_pool}/{vol}@{second}")
    assert [(e["offset"], e["length"]) for e in diff] == [(0, OBJECT)]
    caplog.clear()
    after = until(lambda: pools.agent.upload(pools.rbd, "r", second, StoreSnapshot(
        volume_id=vol, tenant="acme", parent_snapshot_id=first, store_key=KEY)))
    read, sent = OBJECT // CHUNK_SIZE, MiB // CHUNK_SIZE
    assert after.state == "ready" and after.chunks == stored and after.chunks_uploaded == sent, after
    assert (f"snapshot {second} stored in dir:{pools.store.root}: {stored} chunks, {read} read, {sent} new"
            in caplog.text)
    assert len(list(pools.store.list("chunks/"))) == stored + sent

    # RBD -> file: bit for bit, the zeros holes.
    target = ids.new_id("volume")
    restore = RestoreVolume(snapshot_id=second, size_bytes=SIZE, tenant="acme", store_key=KEY)
    assert until(lambda: pools.agent.restore(pools.files, "f", target, restore)).state == "ready"
    assert sha(pools.files.volume_path(target)) == pools.export_sha(f"{vol}@{second}")


def test_a_file_snapshot_restores_onto_rbd_and_a_corrupt_chunk_leaves_no_image(pools: Pools) -> None:
    vol = ids.new_id("volume")
    pools.files.ensure_volume(vol, 16 * MiB)
    data = os.urandom(3 * MiB) + bytes(5 * MiB) + os.urandom(MiB)
    with open(pools.files.volume_path(vol), "r+b") as f:
        f.write(data)
    snap = ids.new_id("snapshot")
    assert until(lambda: pools.files.ensure_snapshot(snap, vol)).state == "ready"
    stored = until(lambda: pools.agent.upload(pools.files, "f", snap, StoreSnapshot(
        volume_id=vol, tenant="acme", store_key=KEY)))
    assert stored.state == "ready" and stored.chunks == 4 * MiB // CHUNK_SIZE  # 4 MiB of data

    # file -> RBD: an image of the size asked (grown past the snapshot's), bit for bit, zeros beyond.
    target = ids.new_id("volume")
    restore = RestoreVolume(snapshot_id=snap, size_bytes=32 * MiB, tenant="acme", store_key=KEY)
    ready = until(lambda: pools.agent.restore(pools.rbd, "r", target, restore))
    assert ready.state == "ready" and ready.size_bytes == 32 * MiB, ready
    assert pools.images() == [target]
    expected = hashlib.sha256(data + bytes(32 * MiB - len(data))).hexdigest()
    assert pools.export_sha(target, 32) == expected
    assert pools.rbd.volume_status(target).state == "ready"

    # A corrupt chunk: the restore fails naming it and the snapshot; no image (nor its partial) stays.
    manifest = find_manifest(pools.store, snap)
    assert manifest is not None
    victim = manifest.chunks[8 * MiB // CHUNK_SIZE]  # the first chunk of the last MiB of data
    path = pools.store.root / chunk_key(victim)
    flip_last_byte(path)
    broken = ids.new_id("volume")
    failed = until(lambda: pools.agent.restore(pools.rbd, "r", broken, restore))
    assert failed.state == "error" and failed.error is not None, failed
    assert victim in failed.error and snap in failed.error and "corrupt" in failed.error
    assert pools.images() == [target], "nothing half-written stays"
    assert pools.rbd.volume_status(broken).state == "absent"


def test_a_partial_image_a_crash_left_is_made_anew_or_removed_with_its_volume(pools: Pools, tmp_path: Path) -> None:
    vol = ids.new_id("volume")
    pools.files.ensure_volume(vol, 8 * MiB)
    data = os.urandom(2 * MiB)
    with open(pools.files.volume_path(vol), "r+b") as f:
        f.write(data)
    snap = ids.new_id("snapshot")
    until(lambda: pools.files.ensure_snapshot(snap, vol))
    until(lambda: pools.agent.upload(pools.files, "f", snap, StoreSnapshot(volume_id=vol, tenant="acme",
                                                                            store_key=KEY)))
    # What an agent killed in the middle of a restore leaves: the partial image, half written.
    target, rolled_back = ids.new_id("volume"), ids.new_id("volume")
    for left in (target, rolled_back):
        subprocess.run(["rbd", "--conf", str(pools.conf), "create", "--size", "8M",
                        f"{pools.rbd_pool}/vbs-partial-{left}"], check=True, capture_output=True, timeout=120)
        pools.write(f"vbs-partial-{left}", 6 * MiB, os.urandom(MiB), tmp_path)
    assert pools.rbd.volume_status(target).state == "absent", "a partial image is no volume"
    assert pools.rbd.inventory().volumes == []
    # The restore, asked again, starts over: the image has the snapshot's bytes only.
    restore = RestoreVolume(snapshot_id=snap, size_bytes=8 * MiB, tenant="acme", store_key=KEY)
    assert until(lambda: pools.agent.restore(pools.rbd, "r", target, restore)).state == "ready"
    assert pools.export_sha(target, 8) == hashlib.sha256(data + bytes(6 * MiB)).hexdigest()
    # The controller's rollback of the other volume removes what was left of it.
    pools.rbd.remove_volume(rolled_back)
    assert pools.images() == [target]


def test_a_snapshot_of_a_volume_deleted_before_its_upload_is_stored_all_the_same(pools: Pools,
                                                                                   tmp_path: Path) -> None:
    vol = ids.new_id("volume")
    pools.rbd.ensure_volume(vol, 16 * MiB)
    data = os.urandom(5 * MiB)
    pools.write(vol, 0, data, tmp_path)
    snap = ids.new_id("snapshot")
    pools.rbd.ensure_snapshot(snap, vol)
    pools.rbd.remove_volume(vol)  # it has a snapshot: its image goes to the RBD trash, nameless
    assert vol not in pools.images() and pools.rbd.snapshot_status(snap).state == "ready"

    done = until(lambda: pools.agent.upload(pools.rbd, "r", snap, StoreSnapshot(volume_id=vol, tenant="acme",
                                                                                 store_key=KEY)))
    chunks = 5 * MiB // CHUNK_SIZE  # 5 MiB of data
    assert done.state == "ready" and done.chunks == chunks and done.chunks_uploaded == chunks, done
    assert pools.images() == [], "the clone it was read through is gone"
    target = ids.new_id("volume")
    restore = RestoreVolume(snapshot_id=snap, size_bytes=16 * MiB, tenant="acme", store_key=KEY)
    assert until(lambda: pools.agent.restore(pools.files, "f", target, restore)).state == "ready"
    assert sha(pools.files.volume_path(target)) == hashlib.sha256(data + bytes(11 * MiB)).hexdigest()
