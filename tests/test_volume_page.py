"""Unit tests of the REST API's page of volumes: encoded from plain dicts (``volumes.VolumePage``), it must
be byte for byte what the models would give, for every kind of field a volume description holds (tags,
attachments, limits of each volume type, an encrypted volume's key, a node's zone and usage, a
volume in error, a node that stopped heartbeating), on SQLite and (integration tier) PostgreSQL."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import update

from tests.conftest import UNIT_DATABASES, fresh_database
from tests.test_scheduler import RecordingEngine
from vbs import ids
from vbs.config import ControllerConfig
from vbs.controller.db import Attachment, Database, Node, Volume
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.nodes import record_storage_heartbeat
from vbs.controller.requests.create_volume import create_volume, create_volume_json
from vbs.controller.requests.describe_volumes import get_volume, volume_page
from vbs.controller.requests.tags import set_tags
from vbs.controller.rest.schemas.volumes import CreateVolumeRequest, VolumeList, VolumeOut
from vbs.wire.storage import PoolInfo, StorageHeartbeat

pytestmark = pytest.mark.unit

GIB = 1 << 30


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)


def heartbeat(db: Database, name: str, zone: str | None, usage: dict[str, int] | None = None) -> None:
    pool = PoolInfo(name="p", backend="file", capacity_bytes=100 * GIB, free_bytes=100 * GIB, clone_method="copy",
                    point_in_time=True)
    with db.session() as s:
        record_storage_heartbeat(s, StorageHeartbeat(name=name, url="http://127.0.0.1:1", address="127.0.0.1",
                                                     started_at=utcnow(), pools=[pool], availability_zone=zone,
                                                     volume_usage=usage or {}))


def controller(db: Database) -> Any:
    return SimpleNamespace(cfg=ControllerConfig(heartbeat_timeout_s=30.0, overcommit_ratio=4.0), db=db,
                           engine=RecordingEngine())


def test_a_page_encoded_from_dicts_is_what_the_models_give(db: Database) -> None:
    heartbeat(db, "s1", "zone-b")
    heartbeat(db, "s2", None)
    svc = controller(db)
    made = [create_volume(svc, CreateVolumeRequest(**body), DEFAULT_TENANT) for body in (
        {"size_gib": 1},
        {"size_gib": 7, "volume_type": "gp2", "comment": "quotes \" and ünïcode", "storage_node": "s1"},
        {"size_gib": 4, "volume_type": "io1", "iops": 200, "multi_attach": True, "storage_node": "s2"},
        {"size_gib": 10, "volume_type": "gp3", "iops": 4000, "throughput": 250},
        {"size_gib": 125, "volume_type": "st1"},
    )]
    first, second, third, fourth, _ = (v.volume_id for v in made)
    heartbeat(db, "s1", "zone-b", {second: 12345})
    now = utcnow()
    with db.session() as s:
        set_tags(s, first, {"Name": "db", "team": "storage"})
        s.execute(update(Volume).where(Volume.id == second).values(status="in-use"))
        s.execute(update(Volume).where(Volume.id == third).values(status="error", status_reason="disk gone"))
        s.add(Attachment(id=ids.new_id("attachment"), volume_id=second, instance_id="i-0123456789abcdef0",
                         host="h1", vm_id="vm1", device="/dev/vdb", mode="rw", status="attached",
                         status_reason=None, created_at=now, updated_at=now))
        # s2 stopped heartbeating: its live volumes are impaired.
        s.execute(update(Node).where(Node.name == "s2").values(last_heartbeat=now - timedelta(minutes=10)))
    with db.session() as s:
        set_tags(s, fourth, {f"k{i}": "v" * i for i in range(5)})

    page = volume_page(svc, DEFAULT_TENANT, [], {}, 1000, None)
    assert len(page.volumes) == 5
    assert page.json() == page.models().model_dump_json().encode()
    # And the models validate back from those bytes to the same descriptions as a single read gives.
    decoded = VolumeList.model_validate_json(page.json())
    assert decoded.volumes == [get_volume(svc, v["volume_id"], DEFAULT_TENANT) for v in page.volumes]
    by_id = {v.volume_id: v for v in decoded.volumes}
    assert by_id[first].tags == {"Name": "db", "team": "storage"}
    assert by_id[second].attachments[0].device == "/dev/vdb" and by_id[second].status == "in-use"
    assert by_id[second].availability_zone == "zone-b" and by_id[second].used_bytes == 12345
    assert by_id[second].iops == 100  # gp2: 3 IOPS per GiB, at least 100
    assert by_id[third].volume_status == "impaired" and by_id[third].status_reason == "disk gone"
    assert (by_id[fourth].iops, by_id[fourth].throughput) == (4000, 250)


def test_a_paged_walk_gives_every_volume_once_with_its_token(db: Database) -> None:
    heartbeat(db, "s1", None)
    svc = controller(db)
    made = {create_volume(svc, CreateVolumeRequest(size_gib=1), DEFAULT_TENANT).volume_id for _ in range(12)}
    # Tags and an attachment on every volume: a page looks them up by its own query of ids, which reads
    # one row past the page; nothing of that row may show on the page.
    now = utcnow()
    with db.session() as s:
        for vid in made:
            set_tags(s, vid, {"Name": vid})
            s.add(Attachment(id=ids.new_id("attachment"), volume_id=vid, instance_id=None, host="h1", vm_id=vid,
                             device="/dev/vdb", mode="rw", status="attached", status_reason=None, created_at=now,
                             updated_at=now))
    seen: list[str] = []
    token = None
    while True:
        page = volume_page(svc, DEFAULT_TENANT, [], {}, 5, token)
        body = json.loads(page.json())
        assert body["next_token"] == page.next_token
        assert body == json.loads(page.models().model_dump_json())
        seen += [v["volume_id"] for v in body["volumes"]]
        for v in body["volumes"]:
            assert v["tags"] == {"Name": v["volume_id"]}
            assert [a["vm_id"] for a in v["attachments"]] == [v["volume_id"]]
        token = page.next_token
        if token is None:
            break
    assert sorted(seen) == sorted(made)


def test_a_create_answer_encoded_from_dicts_is_what_the_model_gives(db: Database) -> None:
    """The REST API answers a create with ``create_volume_json``: the bytes its model would give, for a
    plain, a typed and tagged, and a repeated (client token) create."""
    heartbeat(db, "s1", "zone-b")
    svc = controller(db)
    for body in ({"size_gib": 1}, {"size_gib": 8, "volume_type": "io1", "iops": 400, "tags": {"Name": "ü \""},
                                   "comment": "c"},
                 {"size_gib": 2, "client_token": "tok-1"}, {"size_gib": 2, "client_token": "tok-1"}):
        answer = create_volume_json(svc, CreateVolumeRequest(**body), DEFAULT_TENANT)
        model = VolumeOut.model_validate_json(answer)
        assert answer == model.model_dump_json().encode()
        assert model == get_volume(svc, model.volume_id, DEFAULT_TENANT)
