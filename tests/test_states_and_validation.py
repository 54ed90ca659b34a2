"""Unit tests: conditional state changes, lost races, ids, request validation and filters."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from pydantic import ValidationError

from tests.conftest import UNIT_DATABASES, fresh_database
from vbs import ids
from vbs.controller.db import Attachment, Base, Database, Snapshot, Volume
from vbs.controller.db.states import (
    ATTACHMENT_TRANSITIONS,
    SNAPSHOT_TRANSITIONS,
    VOLUME_TRANSITIONS,
    AttachmentState,
    SnapshotState,
    VolumeState,
    sources,
)
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import transition, try_transition
from vbs.controller.requests import filters
from vbs.controller.rest.schemas.snapshots import CreateSnapshotRequest
from vbs.controller.rest.schemas.volumes import CreateVolumeRequest
from vbs.errors import IncorrectState, InvalidParameter, NotFound, matching
from vbs.wire.connection import HOST_NAME_RE

pytestmark = pytest.mark.unit


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    """The metadata DB, SQLite and (integration tier) PostgreSQL."""
    return fresh_database(request.param, request, tmp_path)


def add_volume(db: Database, status: str = "available") -> str:
    vid = ids.new_id("volume")
    now = utcnow()
    with db.session() as s:
        s.add(Volume(id=vid, size_gib=1, comment="", volume_type="gp3", multi_attach=False, placement="shared",
                     storage_node="n", pool="p", status=status, progress=0, created_at=now, updated_at=now))
    return vid


def status_of(db: Database, vid: str) -> str:
    with db.session() as s:
        return s.get(Volume, vid).status  # type: ignore[union-attr]


def test_migrations_build_exactly_the_models(db: Database) -> None:
    with db.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


def test_transition_moves_only_from_an_allowed_state(db: Database) -> None:
    vid = add_volume(db, "available")
    with db.session() as s:
        transition(s, Volume, vid, VolumeState.DELETING)
    assert status_of(db, vid) == "deleting"
    with pytest.raises(IncorrectState, match="'deleting'"), db.session() as s:
        transition(s, Volume, vid, VolumeState.IN_USE)
    assert status_of(db, vid) == "deleting"


def test_the_state_table_refuses_a_change_it_does_not_allow(db: Database) -> None:
    vid = add_volume(db, "in-use")
    # A caller that asks for a move the table forbids is a bug, refused before any SQL runs.
    with pytest.raises(ValueError, match="may not go from"), db.session() as s:
        transition(s, Volume, vid, VolumeState.DELETING, from_states=[VolumeState.IN_USE])
    # Without from_states the table decides, and an in-use volume is never deleted.
    with pytest.raises(IncorrectState, match="'in-use'; this needs it to be available or error"), db.session() as s:
        transition(s, Volume, vid, VolumeState.DELETING)
    with db.session() as s:
        assert not try_transition(s, Volume, vid, VolumeState.CREATING)
    assert status_of(db, vid) == "in-use"


def test_attachments_and_snapshots_follow_their_tables_too(db: Database) -> None:
    vid = add_volume(db, "in-use")
    now = utcnow()
    with db.session() as s:
        s.add(Attachment(id="att-0123456789abcdef0", volume_id=vid, instance_id=None, host="h", vm_id="vm",
                         device="vdb", mode="rw", status="attaching", created_at=now, updated_at=now))
        s.add(Snapshot(id="snap-0123456789abcdef0", volume_id=vid, volume_size_gib=1, comment="", storage_node="n",
                       pool="p", status="pending", progress=0, started_at=now, updated_at=now))
    with pytest.raises(IncorrectState, match="'attaching'"), db.session() as s:
        transition(s, Attachment, "att-0123456789abcdef0", AttachmentState.DETACHING)  # detach before attached
    with db.session() as s:
        transition(s, Attachment, "att-0123456789abcdef0", AttachmentState.ATTACHED)
        transition(s, Attachment, "att-0123456789abcdef0", AttachmentState.DETACHING)
    with pytest.raises(IncorrectState), db.session() as s:
        transition(s, Snapshot, "snap-0123456789abcdef0", SnapshotState.DELETING)  # still pending
    with pytest.raises(NotFound) as err, db.session() as s:
        transition(s, Attachment, "att-0123456789abcdef1", AttachmentState.DETACHED)
    assert err.value.code == "InvalidAttachment.NotFound"


def test_transition_of_an_unknown_row_is_not_found(db: Database) -> None:
    with pytest.raises(NotFound) as err, db.session() as s:
        transition(s, Volume, "vol-0123456789abcdef0", VolumeState.DELETING)
    assert err.value.code == "InvalidVolume.NotFound"


def test_of_racing_transitions_exactly_one_wins(db: Database) -> None:
    vid = add_volume(db, "available")
    barrier = threading.Barrier(8)
    outcomes: list[str] = []
    lock = threading.Lock()

    def contender() -> None:
        barrier.wait()
        try:
            with db.session() as s:
                transition(s, Volume, vid, VolumeState.DELETING)
            result = "won"
        except IncorrectState:
            result = "lost"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=contender) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * 7 + ["won"]


def test_state_table_matches_ebs() -> None:
    # recoverable: the Recycle Bin deletes it for good once its retention ends (docs/recycle-bin.md).
    assert sources(VOLUME_TRANSITIONS, VolumeState.DELETING) == {VolumeState.AVAILABLE, VolumeState.ERROR,
                                                                 VolumeState.RECOVERABLE}
    assert VOLUME_TRANSITIONS[VolumeState.DELETED] == frozenset()
    assert VolumeState.IN_USE not in sources(VOLUME_TRANSITIONS, VolumeState.DELETING), "attached: never deleted"
    assert SNAPSHOT_TRANSITIONS[SnapshotState.DELETED] == frozenset()
    assert sources(ATTACHMENT_TRANSITIONS, AttachmentState.DETACHING) == {AttachmentState.ATTACHED,
                                                                          AttachmentState.BUSY}


def test_ids_are_ebs_shaped_and_checked() -> None:
    vid = ids.new_id("volume")
    assert ids.is_valid("volume", vid) and len(vid) == 21
    assert ids.virtio_serial(vid) == vid.replace("-", "") and len(ids.virtio_serial(vid)) == 20
    for bad in ["vol-", "vol-0123456789abcdef", "VOL-0123456789abcdef0", "vol-0123456789abcdefg", 5, None]:
        assert not ids.is_valid("volume", bad)
    with pytest.raises(InvalidParameter):
        ids.check("snapshot", vid)


@pytest.mark.parametrize("body", [
    {"size_gib": 0}, {"size_gib": 16385}, {"size_gib": "1"}, {"size_gib": 1, "extra": True},
    {"size_gib": 1, "comment": "\x00"}, {"size_gib": 1, "tags": {"": "v"}}, {"size_gib": 1, "iops": 5},
    {"size_gib": 1, "snapshot_id": "vol-0123456789abcdef0"},
])
def test_create_volume_request_rejects(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CreateVolumeRequest.model_validate_json(__import__("json").dumps(body))


def test_create_requests_accept_the_documented_shapes() -> None:
    req = CreateVolumeRequest.model_validate({"size_gib": 8, "comment": "ok ünïcode", "tags": {"a": ""},
                                              "multi_attach": True, "client_token": "abc-123"})
    assert req.size_gib == 8 and req.volume_type == "gp3"
    assert CreateSnapshotRequest.model_validate({"volume_id": "vol-0123456789abcdef0"}).comment == ""


def test_filters_parse_and_tokens_round_trip() -> None:
    assert filters.parse_filters(["status=available,in-use", "tag:team=db"]) == {
        "status": ["available", "in-use"], "tag:team": ["db"]}
    with pytest.raises(InvalidParameter):
        filters.parse_filters(["status"])
    assert filters.decode_token(filters.encode_token("vol-0123456789abcdef0")) == "vol-0123456789abcdef0"
    with pytest.raises(InvalidParameter):
        filters.decode_token("bm9wZQ")


def test_purge_forgets_deleted_volumes_that_were_attached_with_their_attachments(db: Database) -> None:
    from datetime import timedelta

    from vbs.controller.app import purge_deleted
    from vbs.controller.db import Tag

    vid = add_volume(db, "deleted")
    never = add_volume(db, "deleted")
    recent = add_volume(db, "deleted")
    long_ago = utcnow() - timedelta(hours=2)
    with db.session() as s:
        for v in (vid, never):
            s.get(Volume, v).deleted_at = long_ago  # type: ignore[union-attr]
        s.get(Volume, recent).deleted_at = utcnow()  # type: ignore[union-attr]
        s.add(Attachment(id="att-0123456789abcdef0", volume_id=vid, instance_id=None, host="h", vm_id="vm",
                         device="vdb", mode="rw", status="detached", created_at=long_ago, updated_at=long_ago))
        s.add(Tag(resource_id=vid, key="team", value="db"))

    assert purge_deleted(db, 3600) == 2  # foreign keys are on: the attachment row must go first

    with db.session() as s:
        assert s.get(Volume, vid) is None and s.get(Volume, never) is None and s.get(Volume, recent) is not None
        assert s.get(Attachment, "att-0123456789abcdef0") is None and s.get(Tag, (vid, "team")) is None


@pytest.mark.parametrize("name", ["h1\n", "h1\nx", "", "H1", "-h1"])
def test_a_name_is_matched_whole_a_trailing_newline_too(name: str) -> None:
    # "^...$" patterns with re.match let "h1\n" through; every check matches the whole value.
    from vbs.host.hypervisors.qemu_ids import disk_ids
    from vbs.storage.exports.supervised import check_host

    with pytest.raises(InvalidParameter):
        check_host(name)
    with pytest.raises(InvalidParameter):
        disk_ids(ids.new_id("volume").replace("-", "") + "\n")
    with pytest.raises(InvalidParameter, match="invalid host name"):
        matching(HOST_NAME_RE, name, "host name")
    assert matching(HOST_NAME_RE, "h1", "host name") == "h1"
