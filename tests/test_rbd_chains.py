"""Clone chains and deletion on a real single-node Ceph (Debian's Ceph 16, clone v2).

Backend level: a deleted volume goes to the RBD trash while snapshots of it or clones of its deleted
snapshots remain, its data still read through the clone, and it is purged with the last of them;
snapshots of a trashed volume stay listed and cloneable; images renamed ``vbs-retired-`` by older
agents are taken into the trash; a chain of seven clones is flattened in the background, deepest
first (never an image a clone still reads from), never more than ``max_flattens`` at once (the
flattener's own count), data intact; an agent started later flattens what is too deep. The data
is a pattern file written with ``rbd import`` and read back with ``rbd export``.

Through the controller (REST and EC2): the snapshot over the pool's per-volume limit is refused
with ``VolumeSnapshotLimitExceeded`` before anything is made (a limit of 3 configured on the agent:
450 real snapshots would take minutes; tests/test_snapshot_limit.py covers the default 450), a
volume deeper than the limit is available at once, and ``vbs check`` shows the trash and the chains.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import VBS, Services, wait_until
from tests.export_fixtures import drivers_of
from tests.test_rbd_export import HOST, QSD, _io
from tests.test_security_bounds import ec2_client, ec2_code
from vbs import ids
from vbs.errors import IncorrectState
from vbs.storage.backends.rbd import IMAGE_FEATURES, RbdBackend
from vbs.storage.exports.nbd import NbdExportDriver

pytestmark = pytest.mark.integration

MIB = 1 << 20
SIZE = 16 * MIB


def rbd(ceph: CephForTests, *args: str) -> str:
    proc = subprocess.run(["rbd", "--conf", str(ceph.conf_path), *args], capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stdout


def rbd_json(ceph: CephForTests, *args: str) -> Any:
    return json.loads(rbd(ceph, *args, "--format", "json") or "null")


def pattern_file(where: Path, seed: str, size: int = SIZE) -> tuple[Path, str]:
    """A file of ``size`` bytes that no two seeds share (and that is not zeros): its path and sha256."""
    block = hashlib.sha256(seed.encode()).digest() * (MIB // 32)
    data = b"".join(hashlib.sha256(block + i.to_bytes(4, "big")).digest() + block[32:] for i in range(size // MIB))
    path = where / f"{seed}.raw"
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def import_volume(ceph: CephForTests, backend: RbdBackend, where: Path, seed: str,
                  size: int = SIZE) -> tuple[str, str]:
    """A volume whose image ``rbd import`` wrote from a pattern file (``where/<seed>.raw``, kept): its
    id and the data's sha256."""
    vol = ids.new_id("volume")
    path, sha = pattern_file(where, seed, size)
    rbd(ceph, "import", "--no-progress", "--image-feature", IMAGE_FEATURES, str(path), f"{backend.rbd_pool}/{vol}")
    assert backend.ensure_volume(vol, size).state == "ready"
    return vol, sha


def snapshotted_volume(ceph: CephForTests, backend: RbdBackend, where: Path, seed: str) -> tuple[str, str, str]:
    """``import_volume`` and a snapshot of it: the volume, its data's sha256 and the snapshot."""
    vol, sha = import_volume(ceph, backend, where, seed)
    snap = ids.new_id("snapshot")
    backend.ensure_snapshot(snap, vol)
    return vol, sha, snap


def data_sha(ceph: CephForTests, spec: str, size: int = SIZE) -> str:
    proc = subprocess.run(["rbd", "--conf", str(ceph.conf_path), "export", "--no-progress", spec, "-"],
                          capture_output=True, timeout=120, check=True)
    return hashlib.sha256(proc.stdout[:size]).hexdigest()


def trash_names(ceph: CephForTests, pool: str) -> list[str]:
    return sorted(e["name"] for e in rbd_json(ceph, "trash", "ls", "--all", pool))


@pytest.fixture
def make_backend(ceph: CephForTests) -> Iterator[Any]:
    made: list[RbdBackend] = []
    pool = ceph.new_pool()

    def make(**kw: Any) -> RbdBackend:
        b = RbdBackend("default", ceph.conf_path, rbd_pool=pool, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


# -- the trash -------------------------------------------------------------------------------------


def test_a_deleted_parent_waits_in_the_trash_for_its_last_clone(ceph: CephForTests, make_backend: Any,
                                                                tmp_path: Path) -> None:
    b = make_backend()
    vol, sha, snap = snapshotted_volume(ceph, b, tmp_path, "parent")
    clone = ids.new_id("volume")
    b.ensure_volume(clone, SIZE, snap)
    b.remove_snapshot(snap)  # clone v2: Ceph keeps it in the image's trash namespace for the clone
    assert b.snapshot_status(snap).state == "absent"
    b.remove_volume(vol)
    b.remove_volume(vol)  # idempotent
    assert b.volume_status(vol).state == "absent"
    inv = b.inventory()
    assert inv.volumes == [clone] and inv.snapshots == []
    assert [(t.name, t.kept_for, t.snapshots, t.children) for t in inv.trash] == [(vol, "children", 0, 1)]
    assert trash_names(ceph, b.rbd_pool) == [vol]
    assert data_sha(ceph, f"{b.rbd_pool}/{clone}") == sha, "the clone reads its deleted parent's data"
    b.remove_volume(clone)
    assert trash_names(ceph, b.rbd_pool) == [], "the parent goes with its last clone"
    assert b.inventory().trash == [] and rbd_json(ceph, "ls", b.rbd_pool) == []


def test_snapshots_of_a_trashed_volume_stay_listed_and_cloneable(ceph: CephForTests, make_backend: Any,
                                                                 tmp_path: Path) -> None:
    b = make_backend()
    vol, sha, snap = snapshotted_volume(ceph, b, tmp_path, "kept")
    clone = ids.new_id("volume")
    b.remove_volume(vol)  # EBS: its snapshot outlives it
    inv = b.inventory()
    assert inv.volumes == [] and inv.snapshots == [snap]
    assert [(t.name, t.kept_for, t.snapshots) for t in inv.trash] == [(vol, "snapshots", 1)]
    assert b.snapshot_status(snap).state == "ready"
    assert b.ensure_snapshot(snap, vol).state == "ready"  # a repeated create finds it
    assert b.ensure_volume(clone, 2 * SIZE, snap).size_bytes == 2 * SIZE  # restored for the clone, trashed again
    assert b.ensure_volume(clone, 2 * SIZE, snap).state == "ready"
    assert rbd_json(ceph, "ls", b.rbd_pool) == [clone], "no restored image is left under a name"
    assert data_sha(ceph, f"{b.rbd_pool}/{clone}") == sha
    b.remove_snapshot(snap)  # it has a clone: into the trash namespace
    b.remove_snapshot(snap)
    assert [t.kept_for for t in b.inventory().trash] == ["children"]
    b.remove_volume(clone)
    assert trash_names(ceph, b.rbd_pool) == [] and rbd_json(ceph, "ls", b.rbd_pool) == []


def test_images_retired_by_older_agents_are_taken_into_the_trash(ceph: CephForTests, make_backend: Any,
                                                                 tmp_path: Path) -> None:
    b = make_backend()
    pool = b.rbd_pool
    vol, sha, snap = snapshotted_volume(ceph, b, tmp_path, "legacy")
    bare = ids.new_id("volume")
    # What an agent before the trash did with a deleted volume that had snapshots (and a crash left).
    rbd(ceph, "rename", f"{pool}/{vol}", f"{pool}/vbs-retired-{vol}")
    rbd(ceph, "create", "--size", "1M", f"{pool}/vbs-retired-{bare}")
    b.maintain()
    b.maintain()  # idempotent
    assert rbd_json(ceph, "ls", pool) == []
    assert trash_names(ceph, pool) == [f"vbs-retired-{vol}"]
    assert b.inventory().snapshots == [snap]
    clone = ids.new_id("volume")
    b.ensure_volume(clone, SIZE, snap)
    assert data_sha(ceph, f"{pool}/{clone}") == sha
    b.remove_volume(clone)
    b.remove_snapshot(snap)
    assert trash_names(ceph, pool) == []


# -- clone chains ----------------------------------------------------------------------------------


def chain_of_clones(b: RbdBackend, vol: str, length: int, size: int = SIZE) -> list[str]:
    """``length`` volumes, each a clone of a snapshot of the one before (``vol`` first)."""
    made, parent = [], vol
    for _ in range(length):
        snap, clone = ids.new_id("snapshot"), ids.new_id("volume")
        b.ensure_snapshot(snap, parent)
        status = b.ensure_volume(clone, size, snap)
        assert status.state == "ready", "a clone is usable at once, flattened or not"
        made.append(clone)
        parent = clone
    return made


def test_clones_deeper_than_the_default_five_are_flattened_as_they_are_made(ceph: CephForTests, make_backend: Any,
                                                                             tmp_path: Path) -> None:
    b = make_backend()
    assert b.max_clone_depth == 5
    vol, sha = import_volume(ceph, b, tmp_path, "chain")
    clones = chain_of_clones(b, vol, 7)
    # The sixth's flatten stops when the seventh is cloned from it (unless it ended before): the seventh
    # is flattened, then the next pass flattens the sixth, which no clone reads from any more.
    wait_until(lambda: b._listing().depth(clones[5]) == 0, 600, what="the sixth clone flattened")
    assert b.flattener.wait_idle(600)
    listing = b._listing()
    assert [listing.depth(c) for c in clones[:5]] == [1, 2, 3, 4, 5], "within the limit: left as clones"
    # The sixth is flattened (above): by its own flatten run to the end, or by one the seventh's clone
    # stopped only after its last copy-up (then not counted as completed; the data check below holds).
    assert listing.depth(clones[6]) <= 1  # flattened, or a clone of the sixth flattened before it was made
    if clones[5] in b.flattener.completed and clones[6] in b.flattener.completed:
        assert b.flattener.completed.index(clones[6]) < b.flattener.completed.index(clones[5]), "deepest first"
    for c in clones:
        assert data_sha(ceph, f"{b.rbd_pool}/{c}") == sha, f"{c} lost data"
    assert b.volume_status(clones[5]).progress == 100 and b.inventory().flattens == []


def test_a_flatten_stopped_half_way_and_run_again_keeps_every_byte(ceph: CephForTests, make_backend: Any,
                                                                    tmp_path: Path) -> None:
    """librbd marks an object in the object map before its copy-up writes it, and a flatten skips the
    marked ones: a flatten stopped between the two, run again with the map on, left holes of zeros.
    The backend runs each flatten with the map off and switches it on again after."""
    b = make_backend(max_clone_depth=1)
    size = 512 * MIB  # 128 objects: long enough to stop the flatten half-way
    vol, sha = import_volume(ceph, b, tmp_path, "halfway", size)
    (tmp_path / "halfway.raw").unlink()
    clones = chain_of_clones(b, vol, 2, size)  # the second is one clone too deep: its flatten starts at once
    deep = clones[-1]
    wait_until(lambda: (b.flattener.progress(deep) or 0) >= 10, 120, what="the flatten under way")
    b.flattener.cancel(deep)
    assert b._listing().depth(deep) == 2, "stopped half-way, still a clone"
    assert "object-map" in rbd_json(ceph, "info", f"{b.rbd_pool}/{deep}")["features"], "the map is back on"
    b.maintain()  # what the next pass does: flatten it again
    assert b.flattener.wait_idle(300) and b.flattener.completed == [deep]
    assert b._listing().depth(deep) == 0
    assert {"object-map", "fast-diff"} <= set(rbd_json(ceph, "info", f"{b.rbd_pool}/{deep}")["features"])
    assert data_sha(ceph, f"{b.rbd_pool}/{deep}", size) == sha, "no hole where the first flatten stopped"


class QemuIo:
    """An image held open by QEMU's own rbd driver (what a guest uses), written through qemu-io's
    prompt: after its first write it holds the image's exclusive lock."""

    def __init__(self, ceph: CephForTests, pool: str, image: str) -> None:
        opts = f"driver=raw,file.driver=rbd,file.pool={pool},file.image={image},file.conf={ceph.conf_path}"
        self.proc = subprocess.Popen(["qemu-io", "--image-opts", opts], stdin=subprocess.PIPE,  # noqa: S603
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def write(self, byte: int, offset: int, length: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"write -P 0x{byte:02x} {offset} {length}\n")
        self.proc.stdin.flush()
        while "wrote" not in (line := self.proc.stdout.readline()):
            assert line, "qemu-io ended"
            assert "error" not in line.lower() and "failed" not in line.lower(), line

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


def test_a_clone_open_and_written_in_qemu_is_flattened_with_every_byte(ceph: CephForTests, make_backend: Any,
                                                                       tmp_path: Path) -> None:
    """The object map's switch needs the image's exclusive lock, which the writer holds: librbd hands
    it over on request and takes it back at the next write. Nothing written or inherited is lost."""
    b = make_backend(max_clone_depth=5)
    size = 64 * MIB
    vol, _ = import_volume(ceph, b, tmp_path, "open", size)
    expected = bytearray((tmp_path / "open.raw").read_bytes())
    deep = chain_of_clones(b, vol, 2, size)[-1]
    writer = QemuIo(ceph, b.rbd_pool, deep)
    try:
        writer.write(0xA1, 5 * MIB, 64 << 10)  # takes the lock
        b.max_clone_depth = 1
        b.maintain()
        assert b.flattener.wait_idle(300) and b.flattener.completed == [deep], "flattened while open"
        writer.write(0xB2, 40 * MIB, 64 << 10)  # after the flatten: the lock back, the map on again
    finally:
        writer.close()
    expected[5 * MIB:5 * MIB + (64 << 10)] = b"\xa1" * (64 << 10)
    expected[40 * MIB:40 * MIB + (64 << 10)] = b"\xb2" * (64 << 10)
    assert b._listing().depth(deep) == 0
    assert {"object-map", "fast-diff"} <= set(rbd_json(ceph, "info", f"{b.rbd_pool}/{deep}")["features"])
    assert data_sha(ceph, f"{b.rbd_pool}/{deep}", size) == hashlib.sha256(expected).hexdigest()


def test_a_chain_of_seven_clones_is_flattened_by_an_agent_started_later_deepest_first(
        ceph: CephForTests, make_backend: Any, tmp_path: Path) -> None:
    first = make_backend(max_clone_depth=16)
    vol, sha = import_volume(ceph, first, tmp_path, "restart")
    clones = chain_of_clones(first, vol, 7)
    chains = first.inventory().chains
    assert sorted((c.volume_id, c.depth) for c in chains) == sorted(zip(clones[1:], range(2, 8), strict=True))
    deepest = max(chains, key=lambda c: c.depth)
    assert deepest.volume_id == clones[-1] and deepest.parents[-1].startswith(f"{vol}@")
    first.close()
    # Six clones are too deep, but each of the first five has a clone reading from its snapshot: the
    # deepest is flattened first, then each pass frees the next one up (no flatten runs under a reader).
    later = make_backend(max_clone_depth=1, max_flattens=2)
    wait_until(lambda: all(later._listing().depth(c) <= 1 for c in clones), 600, what="the deep clones flattened")
    assert later.flattener.wait_idle(600)
    assert 1 <= later.flattener.peak <= 2, "never more rbd flatten processes at once than max_flattens"
    assert later.flattener.completed and set(later.flattener.completed) <= set(clones[1:])
    assert later.flattener.completed[0] == clones[-1], "the deepest first"
    for c in clones:
        assert data_sha(ceph, f"{later.rbd_pool}/{c}") == sha, f"{c} lost data in its flatten"
    assert later.inventory().chains == []


def test_a_flatten_frees_a_trashed_parent_and_the_purge_removes_it(ceph: CephForTests, make_backend: Any,
                                                                  tmp_path: Path) -> None:
    first = make_backend(max_clone_depth=16)
    base, sha, sb = snapshotted_volume(ceph, first, tmp_path, "freed")
    vol = ids.new_id("volume")
    first.ensure_volume(vol, SIZE, sb)
    s0, c1 = ids.new_id("snapshot"), ids.new_id("volume")
    first.ensure_snapshot(s0, vol)
    first.ensure_volume(c1, SIZE, s0)  # base@sb <- vol@s0 <- c1: two deep
    first.remove_snapshot(s0)
    first.remove_volume(vol)
    assert [(t.name, t.kept_for) for t in first.inventory().trash] == [(vol, "children")]
    first.close()
    later = make_backend(max_clone_depth=1)  # flattens c1; Ceph then drops s0; the purge then vol
    wait_until(lambda: trash_names(ceph, later.rbd_pool) == [], 600, what="the freed parent purged")
    assert later._listing().depth(c1) == 0
    assert data_sha(ceph, f"{later.rbd_pool}/{c1}") == sha
    assert later.inventory().snapshots == [sb]  # base's own snapshot is untouched


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, QSD)


def test_a_volume_being_flattened_stays_served_and_writable(ceph: CephForTests, make_backend: Any,
                                                            make_driver: Callable[..., NbdExportDriver],
                                                            tmp_path: Path) -> None:
    served = make_backend(max_clone_depth=16, exports=make_driver())
    vol, _ = import_volume(ceph, served, tmp_path, "served")
    _, deep = chain_of_clones(served, vol, 2)
    conn = served.connection_for(deep, HOST)  # the export daemon has the image open from here on
    _io(conn, "write -P 0x5a 0 1M")
    later = make_backend(max_clone_depth=1)  # another agent's flatten, while the daemon holds the image
    wait_until(lambda: deep in later.flattener.completed, 600, what="the flatten of the served volume")
    assert later._listing().depth(deep) == 0
    assert "Pattern verification failed" not in _io(conn, "read -P 0x5a 0 1M")
    _io(conn, "write -P 0x6b 1M 1M")  # still writable through the same export
    served.remove_connection(deep, HOST.name)
    expected = bytearray((tmp_path / "served.raw").read_bytes())
    expected[:MIB], expected[MIB:2 * MIB] = b"\x5a" * MIB, b"\x6b" * MIB
    assert data_sha(ceph, f"{served.rbd_pool}/{deep}") == hashlib.sha256(expected).hexdigest()


def test_a_volume_with_snapshots_that_a_host_has_open_is_not_trashed(ceph: CephForTests, make_backend: Any,
                                                                     make_driver: Callable[..., NbdExportDriver],
                                                                     tmp_path: Path) -> None:
    served = make_backend(exports=make_driver())
    vol, _, snap = snapshotted_volume(ceph, served, tmp_path, "open")
    served.connection_for(vol, HOST)
    with pytest.raises(IncorrectState):  # rbd trash mv would take it: the agent asks rbd status first
        served.remove_volume(vol)
    assert served.volume_status(vol).state == "ready" and trash_names(ceph, served.rbd_pool) == []
    served.remove_connection(vol, HOST.name)
    served.remove_volume(vol)
    assert trash_names(ceph, served.rbd_pool) == [vol] and served.inventory().snapshots == [snap]


# -- through the controller -------------------------------------------------------------------------


@pytest.fixture
def cloud(ceph: CephForTests, tmp_path: Path) -> Iterator[tuple[Services, str]]:
    pool = ceph.new_pool()
    svc = Services(tmp_path)
    try:
        svc.start_controller()
        svc.start_agent("--backend", "rbd", "--export", "nbd", "--ceph-conf", str(ceph.conf_path),
                        "--ceph-user", "admin", "--rbd-pool", pool, "--rbd-max-snapshots-per-volume", "3",
                        "--rbd-max-clone-depth", "2")
        wait_until(lambda: svc.vbs.http.get("/v1/storage-nodes").json().get("storage_nodes"), 60,
                   what="the storage agent's heartbeat")
        yield svc, pool
    finally:
        svc.stop()


def test_the_snapshot_over_the_pools_limit_is_refused_before_anything_is_made(
        ceph: CephForTests, cloud: tuple[Services, str]) -> None:
    svc, pool = cloud
    vbs = svc.vbs
    vol = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(vol, "available", timeout=120)
    for _ in range(3):
        r = vbs.http.post("/v1/snapshots", json={"volume_id": vol})
        assert r.status_code == 200, r.text
        vbs.wait_snapshot(r.json()["snapshot_id"], "completed", timeout=120)
    r = vbs.http.post("/v1/snapshots", json={"volume_id": vol})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "VolumeSnapshotLimitExceeded"
    assert "3" in r.json()["error"]["message"]
    assert ec2_code(lambda: ec2_client(vbs).create_snapshot(VolumeId=vol)) == ("VolumeSnapshotLimitExceeded", 400)
    listed = vbs.http.get("/v1/snapshots").json()["snapshots"]
    assert len([s for s in listed if s["volume_id"] == vol]) == 3
    assert len(rbd_json(ceph, "snap", "ls", f"{pool}/{vol}")) == 3


def check_output(svc: Services, fmt: str) -> str:
    env = {**os.environ, "VBS_ENDPOINT": svc.vbs.endpoint, "VBS_ACCESS_KEY_ID": svc.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": svc.key.secret_access_key, "COLUMNS": "250"}
    proc = subprocess.run([*VBS, "-o", fmt, "check"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_vbs_check_shows_the_trash_and_the_chains_and_deep_volumes_are_available_at_once(
        ceph: CephForTests, cloud: tuple[Services, str]) -> None:
    svc, pool = cloud
    vbs = svc.vbs

    def snapshot(volume_id: str) -> str:
        r = vbs.http.post("/v1/snapshots", json={"volume_id": volume_id})
        assert r.status_code == 200, r.text
        return str(vbs.wait_snapshot(r.json()["snapshot_id"], "completed", timeout=120)["snapshot_id"])

    def from_snapshot(snap: str) -> str:
        vol = vbs.create_volume(snapshot_id=snap)["volume_id"]
        vbs.wait_volume(vol, "available", timeout=120)
        return str(vol)

    base = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(base, "available", timeout=120)
    s0 = snapshot(base)
    one = from_snapshot(s0)
    s1 = snapshot(one)
    two = from_snapshot(s1)
    s2 = snapshot(two)
    three = from_snapshot(s2)  # depth 3 > 2: available at once, flattened behind
    assert vbs.http.delete(f"/v1/volumes/{base}").status_code == 200
    wait_until(lambda: base in [t["name"] for t in rbd_json(ceph, "trash", "ls", pool)], 120, what="base in the trash")
    wait_until(lambda: not json.loads(check_output(svc, "json"))["pools"][0]["flattens"], 600, what="the flatten")
    report = json.loads(check_output(svc, "json"))
    assert report["clean"], report["findings"]
    [details] = report["pools"]
    assert [(t["name"], t["kept_for"], t["snapshots"]) for t in details["trash"]] == [(base, "snapshots", 1)]
    assert [(c["volume_id"], c["depth"], c["parents"]) for c in details["chains"]] == [
        (two, 2, [f"{one}@{s1}", f"{base}@{s0}"])]
    assert vbs.volume(three)["status"] == "available"
    table = check_output(svc, "table")
    assert "trash" in table and base in table and "snapshots" in table
    assert "clone chains deeper than 1" in table and f"{two} <- {one}@{s1}" in table
