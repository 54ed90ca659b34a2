"""What the tier workflows record when they give up, on a real metadata DB: an archive that failed before
anything moved leaves the snapshot standard (as AWS's ``archival-failed``); one that failed while moving it
into a separate archive store holds it as archived (the snapshot store may have lost its manifest already),
so that it is restored (from whichever store holds it) before any volume is made from it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from tests.conftest import fresh_database
from vbs.controller.db import Database, SnapshotTier
from vbs.controller.db.tables import utcnow
from vbs.controller.requests.snapshot_tiers import SnapshotArchived, refuse_if_archived
from vbs.controller.workflows.archive_snapshot import archival_failed

pytestmark = pytest.mark.unit

SNAP = "snap-0123456789abcdef0"


@dataclass
class Context:
    """The part of a step's context the give-up hooks use."""

    db: Database
    resource_id: str = SNAP

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.db.session() as s:
            yield s


@pytest.fixture
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database("sqlite", request, tmp_path)


def archiving(db: Database, archive_store: str | None) -> None:
    with db.session() as s:
        s.add(SnapshotTier(snapshot_id=SNAP, tier="standard", last_status="archival-in-progress",
                           last_started_at=utcnow(), last_progress=40, archive_store=archive_store))


def test_an_archive_that_failed_before_moving_anything_stays_standard(db: Database) -> None:
    archiving(db, None)
    archival_failed(Context(db), "storage node storage-1 unreachable")  # type: ignore[arg-type]
    with db.session() as s:
        row = s.get(SnapshotTier, SNAP)
        assert row is not None and (row.tier, row.last_status) == ("standard", "archival-failed")
        assert row.last_detail == "storage node storage-1 unreachable"
        refuse_if_archived(s, SNAP)  # usable


def test_an_archive_that_failed_while_moving_to_the_archive_store_is_held_archived(db: Database) -> None:
    archiving(db, "dir:/srv/archive")
    archival_failed(Context(db), "storage node storage-1 unreachable")  # type: ignore[arg-type]
    with db.session() as s:
        row = s.get(SnapshotTier, SNAP)
        assert row is not None and (row.tier, row.last_status) == ("archive", "archival-failed")
        assert row.last_detail is not None and "restore it to use it" in row.last_detail
        with pytest.raises(SnapshotArchived):
            refuse_if_archived(s, SNAP)
