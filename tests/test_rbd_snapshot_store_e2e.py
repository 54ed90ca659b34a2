"""RBD snapshots and the snapshot store end to end (docs/snapshots.md "RBD pools"): a controller, a storage
agent ``--backend rbd`` (``storage-1``, on a real single-node Ceph) and one on a file pool (``storage-2``),
both with one ``dir`` store; every process this test's child, stopped by its PID.

A snapshot of an RBD volume is ``completed`` once stored and stays in its pool (``pool+store``); a volume
made from it on the file pool is hydrated from the store, bit for bit; a snapshot of a file volume becomes an
RBD image the same way; a corrupt chunk ends such a volume ``error`` naming the chunk, with no image left.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import VBS, Services, reap_daemons, stop_process, wait_until
from tests.rbd_cloud import rbd_export_sha256, rbd_json
from tests.snapshot_stores import flip_last_byte, sha
from vbs.net.ports import free_port
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.format import CHUNK_SIZE, chunk_key
from vbs.snapshot_store.manifests import find_manifest

pytestmark = pytest.mark.integration

MiB = 1 << 20
GIB_MIB = 1024


class TwoPools:
    """``storage-1`` on an RBD pool, ``storage-2`` on files, one shared store."""

    def __init__(self, ceph: CephForTests, tmp: Path) -> None:
        self.svc = Services(tmp)
        self.tmp = tmp
        self.conf = ceph.conf_path
        self.rbd_pool = ceph.new_pool()
        self.store = tmp / "store"
        self.files = self.svc.data_dir / "pool-2"
        self.files.mkdir()
        self.agent2: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.svc.start_controller()
        self.svc.start_agent("--backend", "rbd", "--export", "nbd", "--ceph-conf", str(self.conf), "--ceph-user",
                             "admin", "--rbd-pool", self.rbd_pool, "--snapshot-store", f"dir:{self.store}")
        self.agent2 = subprocess.Popen(
            [*VBS, "storage-agent", "--node-name", "storage-2", "--port", str(free_port()), "--pool-path",
             str(self.files), "--controller-url", self.svc.vbs.endpoint, "--state-dir",
             str(self.svc.data_dir / "storage-state-2"), "--nbd-port", str(free_port()), "--snapshot-store",
             f"dir:{self.store}"],
            env=self.svc.node_env("storage", "storage-2"), stdout=(self.tmp / "agent-2.log").open("ab"),
            stderr=subprocess.STDOUT)
        wait_until(lambda: {n["name"] for n in self.svc.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
                            if n["state"] == "up"} == {"storage-1", "storage-2"}, 60, what="two storage nodes")

    def stop(self) -> None:
        if self.agent2 is not None:
            stop_process(self.agent2)
        self.svc.stop()
        reap_daemons(self.svc.data_dir / "storage-state-2")

    def volume(self, node: str, **body: Any) -> dict[str, Any]:
        made = self.svc.vbs.create_volume(storage_node=node, **body)
        return self.svc.vbs.wait_volume(made["volume_id"], "available", timeout=300)

    def snapshot(self, volume_id: str) -> dict[str, Any]:
        r = self.svc.vbs.http.post("/v1/snapshots", json={"volume_id": volume_id})
        assert r.status_code == 200, r.text
        return self.svc.vbs.wait_snapshot(r.json()["snapshot_id"], "completed", timeout=300)

    def write_rbd(self, volume_id: str, offset: int, data: bytes) -> None:
        src = self.tmp / "data.bin"
        src.write_bytes(data)
        proc = subprocess.run(["qemu-io", "-f", "raw", f"rbd:{self.rbd_pool}/{volume_id}:conf={self.conf}",
                               "-c", f"write -s {src} {offset} {len(data)}"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stdout + proc.stderr

    def rbd_sha(self, spec: str) -> str:
        return rbd_export_sha256(self.conf, f"{self.rbd_pool}/{spec}", GIB_MIB)

    def images(self) -> set[str]:
        return set(rbd_json(self.conf, "ls", self.rbd_pool))


@pytest.fixture(scope="module")
def pools(ceph: CephForTests, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoPools]:
    p = TwoPools(ceph, tmp_path_factory.mktemp("rbd-store-e2e"))
    try:
        p.start()
        yield p
    finally:
        p.stop()


def test_snapshots_cross_between_rbd_and_file_pools_through_the_store(pools: TwoPools) -> None:
    vbs = pools.svc.vbs
    # -- RBD -> file ------------------------------------------------------------------------------------------
    vol = pools.volume("storage-1", size_gib=1)["volume_id"]
    pools.write_rbd(vol, 0, os.urandom(6 * MiB))
    pools.write_rbd(vol, 700 * MiB, os.urandom(MiB))
    snap = pools.snapshot(vol)
    assert snap["data_location"] == "pool+store" and snap["store_state"] == "stored", snap
    assert snap["stored_bytes"] == 7 * MiB and snap["progress"] == 100
    assert (pools.store / "manifests" / snap["snapshot_id"]).is_file()
    assert snap["snapshot_id"] in {s["name"] for s in rbd_json(pools.conf, "snap", "ls", f"{pools.rbd_pool}/{vol}")}
    # Beside its pool copy (the same node and pool): an RBD clone, as before.
    clone = pools.volume("storage-1", snapshot_id=snap["snapshot_id"])["volume_id"]
    assert rbd_json(pools.conf, "info", f"{pools.rbd_pool}/{clone}")["parent"]["snapshot"] == snap["snapshot_id"]
    # On the file pool: hydrated from the store.
    on_files = pools.volume("storage-2", snapshot_id=snap["snapshot_id"])
    assert on_files["storage_node"] == "storage-2"
    restored = pools.files / "volumes" / f"{on_files['volume_id']}.raw"
    assert sha(restored) == pools.rbd_sha(f"{vol}@{snap['snapshot_id']}")

    # -- file -> RBD ------------------------------------------------------------------------------------------
    fvol = pools.volume("storage-2", size_gib=1)["volume_id"]
    fpath = pools.files / "volumes" / f"{fvol}.raw"
    with fpath.open("r+b") as f:
        f.write(os.urandom(3 * MiB))
        f.seek(900 * MiB)
        f.write(os.urandom(2 * MiB))
        os.fsync(f.fileno())
    expected = sha(fpath)
    fsnap = pools.snapshot(fvol)
    assert fsnap["store_state"] == "stored"
    on_rbd = pools.volume("storage-1", snapshot_id=fsnap["snapshot_id"])
    assert on_rbd["storage_node"] == "storage-1" and on_rbd["volume_id"] in pools.images()
    assert pools.rbd_sha(on_rbd["volume_id"]) == expected

    # -- a corrupt chunk: the RBD volume ends error naming it, and no image of it is left ------------------------
    manifest = find_manifest(DirStore(pools.store), fsnap["snapshot_id"])
    assert manifest is not None
    victim = manifest.chunks[900 * MiB // CHUNK_SIZE]  # the first chunk of the data at 900 MiB
    path = pools.store / chunk_key(victim)
    flip_last_byte(path)
    broken = vbs.create_volume(storage_node="storage-1", snapshot_id=fsnap["snapshot_id"])["volume_id"]
    failed = vbs.wait_volume(broken, "error", timeout=300)
    assert victim in failed["status_reason"] and fsnap["snapshot_id"] in failed["status_reason"], failed
    assert "corrupt" in failed["status_reason"]
    assert not {i for i in pools.images() if broken in i}, "no image (nor partial) of the failed volume"
