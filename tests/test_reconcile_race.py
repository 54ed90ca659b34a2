"""Unit tests of a reconciliation pass against a fake storage agent: a volume that became available
after the agent listed its pool (a create that ended during a long pass) is not marked lost; one
that was available well before the listing and has no file is; which files are orphans and which
rows are missing their file, by state and by pool."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import update

from tests.conftest import UNIT_DATABASES, fresh_database
from tests.test_volume_page import controller, heartbeat
from vbs.controller.db import Database, Volume
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.reconcile import SETTLE_MARGIN_S, Reconciler
from vbs.controller.requests.create_volume import create_volume
from vbs.controller.rest.schemas.volumes import CreateVolumeRequest
from vbs.wire.storage import Inventory, PoolInventory

pytestmark = pytest.mark.unit


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)


class ListingAgent:
    """A storage agent whose pool ``p`` holds ``files``; ``while_listing`` runs after the listing is
    taken, before it is answered (what the rest of the controller does meanwhile)."""

    def __init__(self, files: list[str], while_listing: Any = None) -> None:
        self.files = files
        self.while_listing = while_listing

    def inventory(self) -> Inventory:
        listed = list(self.files)
        if self.while_listing is not None:
            self.while_listing()
        return Inventory(pools={"p": PoolInventory(volumes=listed)})

    def list_exports(self) -> list[Any]:
        return []


def reconciler(db: Database, agent: ListingAgent) -> Reconciler:
    svc = controller(db)
    svc.agents = SimpleNamespace(storage=lambda name: agent)
    return Reconciler(svc, grace_s=60.0, interval_s=3600.0)


def available(db: Database, volume_id: str, *, ago_s: float, state: str = "available", pool: str = "p") -> None:
    with db.session() as s:
        s.execute(update(Volume).where(Volume.id == volume_id)
                  .values(status=state, progress=100, pool=pool, updated_at=utcnow() - timedelta(seconds=ago_s)))


def status(db: Database, volume_id: str) -> str:
    with db.read() as s:
        vol = s.get(Volume, volume_id)
        assert vol is not None
        return vol.status


def test_a_create_that_ends_while_the_pool_is_listed_is_not_marked_lost(db: Database) -> None:
    heartbeat(db, "s1", None)
    svc = controller(db)
    settled = create_volume(svc, CreateVolumeRequest(size_gib=1), DEFAULT_TENANT).volume_id
    fresh = create_volume(svc, CreateVolumeRequest(size_gib=1), DEFAULT_TENANT).volume_id
    available(db, settled, ago_s=600)
    # The listing has the settled volume's file; the fresh one's file is made, and its row marked
    # available, once the listing was taken.
    agent = ListingAgent([settled], while_listing=lambda: (agent.files.append(fresh), available(db, fresh, ago_s=0)))
    report = reconciler(db, agent).run(repair=True)
    assert not report.findings, report.as_dict()
    assert status(db, fresh) == "available"
    # A later pass lists it.
    agent.while_listing = None
    assert reconciler(db, agent).run(repair=True).findings == []


def test_a_volume_settled_before_the_listing_without_its_file_is_marked_lost(db: Database) -> None:
    heartbeat(db, "s1", None)
    svc = controller(db)
    lost = create_volume(svc, CreateVolumeRequest(size_gib=1), DEFAULT_TENANT).volume_id
    recent = create_volume(svc, CreateVolumeRequest(size_gib=1), DEFAULT_TENANT).volume_id
    available(db, lost, ago_s=SETTLE_MARGIN_S + 5)
    available(db, recent, ago_s=0)  # no file either, but changed just now: judged by a later pass
    report = reconciler(db, ListingAgent([])).run(repair=True)
    assert [(f.kind, f.resource_id, f.action) for f in report.findings] == [("missing-file", lost, "repaired")]
    assert status(db, lost) == "error" and status(db, recent) == "available"


def test_orphans_and_missing_files_are_judged_by_state_and_pool(db: Database) -> None:
    heartbeat(db, "s1", None)
    svc = controller(db)
    made = [create_volume(svc, CreateVolumeRequest(size_gib=1), DEFAULT_TENANT).volume_id for _ in range(6)]
    creating, failed, in_use, other_pool, deleted, kept = made
    old = SETTLE_MARGIN_S + 5
    available(db, failed, ago_s=old, state="error")
    available(db, in_use, ago_s=old, state="in-use")
    available(db, other_pool, ago_s=old, pool="q")  # recorded in pool q, which this listing is not
    available(db, deleted, ago_s=old, state="deleted")
    available(db, kept, ago_s=old)
    unknown = "vol-" + "0" * 17
    # Pool p holds the creating volume's file (expected), the failed and deleted ones' (orphans), one
    # that has no row (an orphan) and the kept one's; the in-use volume's file is gone.
    agent = ListingAgent([creating, failed, deleted, unknown, kept])
    report = reconciler(db, agent).run(repair=True)
    found = sorted((f.kind, f.resource_id, f.action) for f in report.findings)
    assert found == sorted([("orphan-file", failed, "waiting"), ("orphan-file", deleted, "waiting"),
                            ("orphan-file", unknown, "waiting"), ("missing-file", in_use, "reported")])
    details = {f.resource_id: f.detail for f in report.findings}
    assert details[failed] == "volume file in pool p with row error"
    assert details[unknown] == "volume file in pool p with no row"
    assert details[in_use] == "volume is in-use but its file is gone"
    # An in-use volume is reported, not marked: its VM may still hold the data open.
    assert status(db, in_use) == "in-use" and status(db, other_pool) == "available"
