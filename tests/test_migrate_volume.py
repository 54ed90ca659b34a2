"""Unit tests of ``vbs migrate-volume``'s checks (controller/moves.py), on the DB alone: what is refused
before any operation starts, and what a move that may start records. The move itself, on a real Ceph
with two agents, is tests/test_rbd_up.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from tests.conftest import UNIT_DATABASES, fresh_database
from tests.fakes import RecordingEngine
from tests.test_scheduler import controller, heartbeat, place, pool, shared_pool, silence
from vbs import ids
from vbs.controller.db import Attachment, Database, Node, Snapshot, Volume
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.nodes import StorageNodeInfo, record_host_heartbeat, storage_info
from vbs.controller.requests.migrate_volume import migrate_volume
from vbs.controller.rest.schemas.volumes import MigrateVolumeRequest
from vbs.errors import IncorrectState, InsufficientCapacity, InvalidParameter, NotFound
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities
from vbs.wire.storage import ExportInfo

pytestmark = pytest.mark.unit


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)



def move(db: Database, volume_id: str, node: str, pool_name: str | None = None) -> Any:
    svc = controller(db)
    svc.engine = RecordingEngine()
    out = migrate_volume(svc, volume_id, MigrateVolumeRequest(storage_node=node, pool=pool_name), DEFAULT_TENANT)
    return out, svc.engine.begun


def volume_on(db: Database, node: str) -> str:
    with db.read() as s:
        return str(s.scalars(select(Volume.id).where(Volume.storage_node == node)).first())


def test_a_volume_of_a_shared_pool_may_move_to_another_agent_of_it_and_only_there(db: Database) -> None:
    heartbeat(db, "s1", shared_pool("ceph", 10))
    heartbeat(db, "s2", shared_pool("ceph", 10))
    heartbeat(db, "s3", shared_pool("other", 10, shared_id="ceph:0c4e2f1a-0000-4000-8000-000000000002/vbs"))
    place(db)
    vol = volume_on(db, "s1")
    with pytest.raises(InvalidParameter, match="serves no pool of the storage"):
        move(db, vol, "s3")
    with pytest.raises(InvalidParameter, match="does not exist"):
        move(db, vol, "s9")
    with pytest.raises(InvalidParameter, match="already served"):
        move(db, vol, "s1")
    out, begun = move(db, vol, "s2")
    assert (out.source_node, out.target_node, out.target_pool) == ("s1", "s2", "ceph")
    assert [(k, r) for k, r, _ in begun] == [("migrate-volume", vol)]
    assert (begun[0][2].node, begun[0][2].target_node) == ("s1", "s2")


def test_an_available_volume_of_files_is_copied_into_a_pool_of_the_target_with_room(db: Database) -> None:
    heartbeat(db, "s1", pool("files", 10))
    heartbeat(db, "s2", pool("tiny", 0.5), pool("files", 10))
    place(db)
    vol = volume_on(db, "s1")  # equal pools: the first by name takes the volume
    with pytest.raises(InsufficientCapacity, match="no room"):
        move(db, vol, "s2", "tiny")
    with pytest.raises(InvalidParameter, match="no pool of its own named 'nope'"):
        move(db, vol, "s2", "nope")
    out, begun = move(db, vol, "s2")
    assert (out.target_node, out.target_pool) == ("s2", "files")
    kind, resource, params = begun[0]
    assert (kind, resource, params.size_gib, params.host) == ("migrate-volume-copy", vol, 1, None)


def attach(db: Database, vol: str, host: str, *, status: str = "attached", mirror: bool = True) -> None:
    with db.session() as s:
        record_host_heartbeat(s, HostHeartbeat(
            name=host, url="http://127.0.0.1:2", address="127.0.0.1", started_at=utcnow(), vms=[], hypervisor="qemu",
            capabilities=HypervisorCapabilities(protocols=["nbd"], mirror=mirror)))
        s.add(Attachment(id=ids.new_id("attachment"), volume_id=vol, host=host, vm_id="vm1", device="/dev/vdb",
                         mode="rw", status=status, created_at=utcnow(), updated_at=utcnow()))
        s.execute(update(Volume).where(Volume.id == vol).values(status="in-use"))


def test_an_attached_volume_of_files_is_mirrored_by_its_one_vms_hypervisor(db: Database) -> None:
    heartbeat(db, "s1", pool("files", 10))
    heartbeat(db, "s2", pool("files", 10))
    place(db)
    vol = volume_on(db, "s1")
    attach(db, vol, "host-1")
    out, begun = move(db, vol, "s2")
    kind, _resource, params = begun[0]
    assert (kind, params.host, params.vm_id, out.target_pool) == ("migrate-volume-mirror", "host-1", "vm1", "files")


@pytest.mark.parametrize(("case", "refusal"), [
    ("no-mirror", "cannot move an attached disk"),
    ("two-vms", "attached to 2 VMs"),
    ("attaching", "is 'attaching'"),
    ("encrypted", "is encrypted"),
])
def test_an_attached_volume_that_cannot_be_mirrored_is_refused(db: Database, case: str, refusal: str) -> None:
    heartbeat(db, "s1", pool("files", 10))
    heartbeat(db, "s2", pool("files", 10))
    place(db)
    vol = volume_on(db, "s1")
    attach(db, vol, "host-1", mirror=case != "no-mirror", status="attaching" if case == "attaching" else "attached")
    if case == "two-vms":
        attach(db, vol, "host-2")
    if case == "encrypted":
        with db.session() as s:
            s.execute(update(Volume).where(Volume.id == vol).values(key_id="key-0123456789abcdef0"))
    with pytest.raises(IncorrectState, match=refusal):
        move(db, vol, "s2")


def test_a_down_or_drained_target_an_export_of_the_old_agent_or_a_pending_snapshot_refuse(db: Database) -> None:
    heartbeat(db, "s1", shared_pool("ceph", 10))
    heartbeat(db, "s2", shared_pool("ceph", 10))
    place(db)
    vol = volume_on(db, "s1")
    silence(db, "s2")
    with pytest.raises(IncorrectState, match="down"):
        move(db, vol, "s2")
    heartbeat(db, "s2", shared_pool("ceph", 10))
    with db.session() as s:
        s.execute(update(Node).where(Node.name == "s2").values(drained=True))
    with pytest.raises(IncorrectState, match="drained"):
        move(db, vol, "s2")
    with db.session() as s:
        s.execute(update(Node).where(Node.name == "s2").values(drained=False))
        node = s.get(Node, ("s1", "storage"))
        assert node is not None
        info = storage_info(node)
        node.info = StorageNodeInfo(pools=info.pools, exports=[
            ExportInfo(key=vol, host="host-1", protocol="nbd", target="x")]).model_dump(mode="json")
    with pytest.raises(IncorrectState, match="through an export of 's1'"):
        move(db, vol, "s2")
    heartbeat(db, "s1", shared_pool("ceph", 10))  # no export any more
    with db.session() as s:
        s.add(Snapshot(id=ids.new_id("snapshot"), volume_id=vol, volume_size_gib=1, comment="", storage_node="s1",
                       pool="ceph", status="pending", progress=0, started_at=utcnow(), updated_at=utcnow(),
                       tenant=DEFAULT_TENANT))
    with pytest.raises(IncorrectState, match="is being taken"):
        move(db, vol, "s2")


def test_an_unknown_volume_is_not_found(db: Database) -> None:
    heartbeat(db, "s1", shared_pool("ceph", 10))
    with pytest.raises(NotFound):
        move(db, "vol-0000000000000000a", "s1")
