"""Issue 33, phase 1, end to end: snapshots go to the snapshot store, through a real ``vbs up`` (controller,
two storage agents and a host agent as processes) and a real store — a directory both agents share, and
an S3 bucket on moto's S3 server that is down when the snapshot is taken.

On the default pool (ext4 in the test's temporary directory: clones are copies) a snapshot is
``completed`` only once its manifest is in the store, and its pool copy is then given up; describe says
where it lives; a volume made from it is hydrated from the store bit for bit, on either storage node (the
one it was taken on, or the other); the next snapshot sends
only the chunks that changed; a corrupt chunk fails a restore with the chunk and the snapshot named and
the volume ``error``; deleting the source volume leaves the stored snapshot restorable; delete-snapshot
removes its manifest. A store that is down leaves the snapshot pending with the reason until it is back.
The same through a real RADOS Gateway (S3 on the session's Ceph cluster): snapshots stored in its bucket
and restored bit for bit on the other storage node, incrementally.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer
from sqlalchemy import select

from tests.ceph_cluster import RadosGatewayForTests
from tests.conftest import VBS, Vbs, VbsUp, wait_until
from tests.snapshot_stores import flip_last_byte, pattern, sha, write_at
from vbs.controller.auth.keys import MasterKey
from vbs.controller.auth.store_key import store_key
from vbs.controller.db import Database, Operation
from vbs.net.ports import free_port
from vbs.snapshot_store import CHUNK_SIZE
from vbs.snapshot_store.s3 import read_credentials

pytestmark = pytest.mark.integration

MiB = 1 << 20
FAKE_SECRET = "s3cr3t-" + "y" * 33  # moto takes any key; this one must never show up in a log


def volume_file(vbs: Vbs, volume: dict[str, Any]) -> Path:
    """The pool file of a volume, on whichever of the two storage nodes it was placed."""
    node = vbs.volume(volume["volume_id"])["storage_node"]
    pool = vbs.pool if node == "storage-1" else vbs.data_dir / "pools" / node
    return pool / "volumes" / f"{volume['volume_id']}.raw"


def chunk_files(store: Path) -> set[Path]:
    return {p for p in (store / "chunks").rglob("*") if p.is_file() and not p.name.startswith(".")}


def snapshot_until_done(vbs: Vbs, volume_id: str) -> tuple[dict[str, Any], list[int]]:
    """Take a snapshot and follow it until it is completed; its progress as seen on the way."""
    snap = vbs.cli("create-snapshot", volume_id)
    seen = [snap["progress"]]
    while (cur := vbs.snapshot(snap["snapshot_id"]))["status"] == "pending":
        seen.append(cur["progress"])
        time.sleep(0.05)
    assert cur["status"] == "completed", cur
    return cur, seen


@pytest.fixture(scope="module")
def vbs_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    tmp = tmp_path_factory.mktemp("store-e2e")
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=["--storage-nodes", "2"])  # one store for both
    try:
        yield up.start()
    finally:
        up.stop()


def test_snapshots_go_to_the_store_and_come_back_from_it(vbs_dir: Vbs) -> None:
    vbs = vbs_dir
    store = vbs.data_dir / "snapshots"
    log = (vbs.data_dir.parent / "vbs-up.log").read_text()
    assert f"Snapshots go to dir:{store}" in log and "protects against a lost pool directory only" in log

    vol = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")
    vol_id = vol["volume_id"]
    vol_path = vbs.pool / "volumes" / f"{vol_id}.raw"
    # 6 MiB of data at the start, 1 MiB at 100 MiB; the rest zeros (never stored).
    write_at(vol_path, 0, pattern(b"first", 6))
    write_at(vol_path, 100 * MiB, pattern(b"far", 1))
    image = sha(vol_path)

    # -- a snapshot is completed once it is stored, and its copy pool gives its full copy up ----------------
    first, seen = snapshot_until_done(vbs, vol_id)
    snap1 = first["snapshot_id"]
    assert seen == sorted(seen), "progress never goes back"
    assert (store / "manifests" / snap1).is_file(), "completed means its manifest is in the store"
    assert first["data_location"] == "store" and first["store_state"] == "stored"
    assert first["stored_bytes"] == 7 * MiB and first["progress"] == 100
    assert not (vbs.pool / "snapshots" / f"{snap1}.raw").exists(), "a copy pool keeps no full copy"
    chunks_after_first = chunk_files(store)
    assert len(chunks_after_first) == 7 * MiB // CHUNK_SIZE  # every chunk of pattern() is its own
    for path in chunks_after_first:  # 0600 files in 0700 directories: the store holds every tenant's data
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    # describe-snapshots: the CLI's table and the EC2 API say it too.
    env = {**os.environ, "VBS_ENDPOINT": vbs.endpoint, "VBS_ACCESS_KEY_ID": vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key}
    table = subprocess.run([*VBS, "-o", "table", "describe-snapshots", snap1], env=env, capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0 and "Location" in table.stdout and "store" in table.stdout, table.stdout
    ec2 = vbs.ec2().describe_snapshots(SnapshotIds=[snap1])["Snapshots"][0]
    assert ec2["Progress"] == "100%" and ec2["State"] == "completed"

    # -- restored from the store, bit for bit (the pool has no copy to clone), on either node ------------------
    clone = vbs.cli("create-volume", "--snapshot", snap1, "--wait")
    assert clone["status"] == "available", clone
    assert sha(volume_file(vbs, clone)) == image
    elsewhere = vbs.cli("create-volume", "--snapshot", snap1, "--storage-node", "storage-2", "--wait")
    assert elsewhere["status"] == "available" and elsewhere["storage_node"] == "storage-2", elsewhere
    assert sha(vbs.data_dir / "pools" / "storage-2" / "volumes" / f"{elsewhere['volume_id']}.raw") == image

    # -- the next snapshot sends only the chunks that changed -------------------------------------------------
    write_at(vol_path, 2 * MiB, pattern(b"changed", 1))
    second, _ = snapshot_until_done(vbs, vol_id)
    snap2 = second["snapshot_id"]
    new_chunks = chunk_files(store) - chunks_after_first
    changed = MiB // CHUNK_SIZE  # the chunks of the 1 MiB written (aligned)
    assert len(new_chunks) == changed, "1 MiB changed: its chunks sent, no other"
    assert f", {changed} new (" in (vbs.data_dir.parent / "vbs-up.log").read_text()

    # -- vbs check reads both manifests in the store and finds every chunk they list ------------------------------
    checked = vbs.cli("check")
    assert checked["clean"] and not checked["unstored"], checked
    (checked_store,) = checked["stores"]
    assert checked_store["store"] == f"dir:{store}" and checked_store["snapshots"] == 2
    assert checked_store["chunks_checked"] == (7 + 1) * MiB // CHUNK_SIZE  # 7 MiB of the first, 1 MiB new in the second

    # -- a corrupt chunk fails the restore, naming it; nothing half-written is left available ------------------
    victim = min(new_chunks)  # one of the second snapshot's own chunks
    flip_last_byte(victim)
    # Only a deep check, which hashes every chunk again, sees it (a plain one finds every chunk there).
    assert vbs.cli("check")["clean"]
    deep = vbs.cli("check", "--deep", check=False)
    assert deep.returncode == 1, deep.stderr
    (finding,) = json.loads(deep.stdout)["findings"]
    assert finding["kind"] == "store-corrupt-chunk" and finding["resource_id"] == snap2, finding
    assert victim.name in finding["detail"]
    broken = vbs.cli("create-volume", "--snapshot", snap2)
    failed = vbs.wait_volume(broken["volume_id"], "error", timeout=120)
    assert victim.name in failed["status_reason"] and snap2 in failed["status_reason"], failed
    assert "corrupt" in failed["status_reason"]
    for pool in (vbs.pool, vbs.data_dir / "pools" / "storage-2"):
        assert not list((pool / "volumes").glob(f"{broken['volume_id']}.raw*"))

    # -- deleting the source volume leaves its stored snapshots restorable ------------------------------------
    vbs.cli("delete-volume", vol_id, "--wait")
    assert (store / "manifests" / snap1).is_file()
    again = vbs.cli("create-volume", "--snapshot", snap1, "--size", "2", "--wait")
    again_path = volume_file(vbs, again)
    assert again_path.stat().st_size == 2 << 30 and sha(again_path, 1 << 30) == image

    # -- delete-snapshot removes its manifest (its chunks go with garbage collection) --------------------------
    vbs.cli("delete-snapshot", snap1, "--wait")
    assert not (store / "manifests" / snap1).exists()
    assert (store / "manifests" / snap2).is_file()
    # The store key goes with each call only: not in a log, an operation row or a file of the agent's.
    db = Database.for_data_dir(vbs.data_dir)
    try:
        key = store_key(db, MasterKey(vbs.data_dir / "master.key")).get_secret_value()
        with db.read() as s:
            rows = [json.dumps(params) for params in s.scalars(select(Operation.params))]
            first_op = s.scalars(select(Operation.params).where(Operation.kind == "create-snapshot",
                                                                Operation.resource_id == snap1)).one()
    finally:
        db.dispose()
    assert rows and not any(key in row for row in rows)
    # The point-in-time view was ready at once: the upload, not a copy, took all of the snapshot's progress.
    assert first_op["ready_at_once"], first_op
    assert key not in (vbs.data_dir.parent / "vbs-up.log").read_text()
    assert not list(vbs.data_dir.rglob("snapshot-store.key"))


@pytest.fixture(scope="module")
def s3_later(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vbs, int, Path]]:
    """``vbs up`` whose store is a bucket on an S3 server that is not running yet (started by the test)."""
    tmp = tmp_path_factory.mktemp("store-s3")
    creds = tmp / "s3-credentials"
    creds.write_text(f"[default]\naws_access_key_id = AKIAVBSTEST\naws_secret_access_key = {FAKE_SECRET}\n")
    creds.chmod(0o600)
    port = free_port()
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=[
        "--snapshot-store", "s3://vbs-e2e/site-a", "--s3-endpoint", f"http://127.0.0.1:{port}",
        "--s3-credentials-file", str(creds)])
    try:
        yield up.start(), port, tmp / "vbs-up.log"
    finally:
        up.stop()


def test_a_store_that_is_down_keeps_the_snapshot_pending_until_it_is_back(s3_later: tuple[Vbs, int, Path]) -> None:
    vbs, port, log = s3_later
    vol = vbs.cli("create-volume", "--size", "1", "--wait")
    vol_path = vbs.pool / "volumes" / f"{vol['volume_id']}.raw"
    write_at(vol_path, 0, pattern(b"s3", 3))
    image = sha(vol_path)
    snap = vbs.cli("create-snapshot", vol["volume_id"])
    pending = wait_until(lambda: (s := vbs.snapshot(snap["snapshot_id"]))["status_reason"] and s, 120,
                         what="the reason it waits")
    assert pending["status"] == "pending" and "waiting for the snapshot store" in pending["status_reason"]
    assert "s3://vbs-e2e/site-a/" in pending["status_reason"]
    assert pending["data_location"] == "pool"
    # vbs check lists it among the snapshots not in their store yet, with the reason.
    (unstored,) = vbs.cli("check")["unstored"]
    assert unstored["snapshot_id"] == snap["snapshot_id"] and "waiting for the snapshot store" in unstored["reason"]

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="AKIAVBSTEST", aws_secret_access_key=FAKE_SECRET)
        s3.create_bucket(Bucket="vbs-e2e")
        done = vbs.wait_snapshot(snap["snapshot_id"], "completed", timeout=180)
        assert done["data_location"] == "store" and done["status_reason"] is None
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="vbs-e2e", Prefix="site-a/")["Contents"]}
        assert f"site-a/manifests/{snap['snapshot_id']}" in keys
        assert len([k for k in keys if k.startswith("site-a/chunks/")]) == 3 * MiB // CHUNK_SIZE
        clone = vbs.cli("create-volume", "--snapshot", snap["snapshot_id"], "--wait")
        assert sha(vbs.pool / "volumes" / f"{clone['volume_id']}.raw") == image
    finally:
        server.stop()
    assert FAKE_SECRET not in log.read_text()


@pytest.fixture(scope="module")
def vbs_radosgw(tmp_path_factory: pytest.TempPathFactory, radosgw: RadosGatewayForTests) -> Iterator[Vbs]:
    """``vbs up`` with two storage nodes whose one store is a bucket of the session's RADOS Gateway."""
    tmp = tmp_path_factory.mktemp("store-radosgw")
    radosgw.gateway.create_bucket("vbs-e2e", radosgw.credentials)
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=[
        "--storage-nodes", "2", "--snapshot-store", "s3://vbs-e2e/site-b", "--s3-endpoint", radosgw.endpoint,
        "--s3-credentials-file", str(radosgw.credentials)])
    try:
        yield up.start()
    finally:
        up.stop()


def test_snapshots_stored_in_radosgw_restore_bit_exact_on_the_other_node(vbs_radosgw: Vbs,
                                                                          radosgw: RadosGatewayForTests) -> None:
    vbs = vbs_radosgw
    s3 = boto3.client("s3", endpoint_url=radosgw.endpoint, region_name="us-east-1",
                      **read_credentials(radosgw.credentials, "default"))

    def keys(kind: str) -> set[str]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket="vbs-e2e", Prefix=f"site-b/{kind}/")
        return {o["Key"] for page in pages for o in page.get("Contents", [])}

    vol = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")
    vol_path = vbs.pool / "volumes" / f"{vol['volume_id']}.raw"
    write_at(vol_path, 0, pattern(b"rgw", 4))
    write_at(vol_path, 512 * MiB, pattern(b"rgw-far", 1))
    image = sha(vol_path)

    first, _ = snapshot_until_done(vbs, vol["volume_id"])
    assert first["data_location"] == "store" and first["stored_bytes"] == 5 * MiB, first
    assert f"site-b/manifests/{first['snapshot_id']}" in keys("manifests")
    first_chunks = keys("chunks")
    assert len(first_chunks) == 5 * MiB // CHUNK_SIZE and not keys("uploads")

    write_at(vol_path, 3 * MiB, pattern(b"rgw-changed", 1))
    changed = sha(vol_path)
    second, _ = snapshot_until_done(vbs, vol["volume_id"])
    assert len(keys("chunks") - first_chunks) == MiB // CHUNK_SIZE, "1 MiB changed: its chunks sent, no other"

    # Restored from the bucket on the other storage node (its pool has no copy of either snapshot).
    for snap, expected in ((first, image), (second, changed)):
        made = vbs.cli("create-volume", "--snapshot", snap["snapshot_id"], "--storage-node", "storage-2", "--wait")
        assert made["status"] == "available" and made["storage_node"] == "storage-2", made
        assert sha(vbs.data_dir / "pools" / "storage-2" / "volumes" / f"{made['volume_id']}.raw") == expected

    vbs.cli("delete-snapshot", first["snapshot_id"], "--wait")
    assert f"site-b/manifests/{first['snapshot_id']}" not in keys("manifests")
    assert radosgw.secret_key() not in (vbs.data_dir.parent / "vbs-up.log").read_text()


@pytest.fixture(scope="module")
def s3_never(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    """``vbs up`` whose store is a bucket on an S3 server that never runs, and a controller that gives a
    failing step up after a few seconds."""
    tmp = tmp_path_factory.mktemp("store-never")
    creds = tmp / "s3-credentials"
    creds.write_text(f"[default]\naws_access_key_id = AKIAVBSTEST\naws_secret_access_key = {FAKE_SECRET}\n")
    creds.chmod(0o600)
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", env={"VBS_CONTROLLER_GIVE_UP_AFTER_S": "8"}, extra=[
        "--snapshot-store", "s3://vbs-e2e/never", "--s3-endpoint", f"http://127.0.0.1:{free_port()}",
        "--s3-credentials-file", str(creds)])
    try:
        yield up.start()
    finally:
        up.stop()


def test_an_upload_given_up_leaves_nothing_of_the_snapshot_in_its_copy_pool(s3_never: Vbs) -> None:
    """On a copy pool the snapshot was a point-in-time view in the export daemon (no full copy): once its
    upload is given up, the view and its scratch file are gone too."""
    vbs = s3_never
    vol = vbs.cli("create-volume", "--size", "1", "--wait")
    write_at(vbs.pool / "volumes" / f"{vol['volume_id']}.raw", 0, pattern(b"never", 2))
    snap = vbs.cli("create-snapshot", vol["volume_id"])
    failed = vbs.wait_snapshot(snap["snapshot_id"], "error", timeout=180)
    assert "could not be stored" in failed["status_reason"], failed
    assert list((vbs.pool / "snapshots").iterdir()) == [], "no copy, scratch file or hold is left"
    views = [p for d in vbs.data_dir.rglob("views") for p in d.iterdir()]
    assert views == [], "no view is left in the export daemon"
    pid = next(int(p.read_text()) for p in vbs.data_dir.rglob("qsd.pid"))
    held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert not any("scratch" in name or vol["volume_id"] in name for name in held), held


@pytest.fixture(scope="module")
def iscsi_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    """``vbs up`` whose storage node exports over iSCSI (tgtd: no point-in-time view of its own)."""
    tmp = tmp_path_factory.mktemp("store-iscsi")
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=["--export", "iscsi"])
    try:
        yield up.start()
    finally:
        up.stop()


def test_a_detached_volume_of_an_iscsi_node_is_stored_with_no_copy_in_its_pool(iscsi_up: Vbs) -> None:
    """No export daemon view: the volume file itself is read while its exports are held off."""
    vbs = iscsi_up
    vol = vbs.cli("create-volume", "--size", "1", "--wait")
    vol_path = vbs.pool / "volumes" / f"{vol['volume_id']}.raw"
    write_at(vol_path, 0, pattern(b"iscsi", 3))
    write_at(vol_path, 500 * MiB, pattern(b"iscsi-far", 1))
    image = sha(vol_path)
    done, _ = snapshot_until_done(vbs, vol["volume_id"])
    assert done["data_location"] == "store" and done["stored_bytes"] == 4 * MiB
    assert list((vbs.pool / "snapshots").iterdir()) == [], "no copy and no hold is left"
    clone = vbs.cli("create-volume", "--snapshot", done["snapshot_id"], "--wait")
    assert sha(vbs.pool / "volumes" / f"{clone['volume_id']}.raw") == image
