"""Unit tests of full disks (docs/operations.md "A full pool", "A full metadata disk"): a pool below its
reserve is skipped by placement and refused with InsufficientVolumeCapacity, a SQLite database that
cannot grow answers DatabaseFull, and the QEMU driver resumes only VMs that a VBS disk's lack of space
paused. ``tests/test_full_disks.py`` proves the same with real filesystems, daemons and a guest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.test_scheduler import GIB, heartbeat, place, pool
from vbs.controller.db import Database
from vbs.controller.db.session import DatabaseFull
from vbs.controller.placement.room import FULL_RESERVE_MAX_BYTES, full_reserve_bytes, is_full
from vbs.errors import InsufficientCapacity
from vbs.host.hypervisors.qemu import _cont_if_paused_for_space
from vbs.wire.storage import PoolInfo

pytestmark = pytest.mark.unit


def with_free(p: PoolInfo, free: int) -> PoolInfo:
    return p.model_copy(update={"free_bytes": free})


def test_the_reserve_is_one_percent_of_a_pool_and_at_most_a_gib() -> None:
    assert full_reserve_bytes(192 << 20) == (192 << 20) // 100
    assert full_reserve_bytes(10 << 40) == FULL_RESERVE_MAX_BYTES
    small = pool("p", 1)
    assert not is_full(small) and is_full(with_free(small, GIB // 100 - 1))
    assert not is_full(with_free(small, GIB // 100))
    lost = small.model_copy(update={"free_bytes": 0, "capacity_bytes": 0, "lost": "/srv/pool is gone"})
    assert not is_full(lost)  # lost, not full


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = Database.for_data_dir(tmp_path)
    db.migrate()
    return db


def test_placement_skips_a_full_pool_and_refuses_when_every_pool_is_full(db: Database) -> None:
    heartbeat(db, "a", with_free(pool("p", 100), 0))
    heartbeat(db, "b", pool("p", 10))
    assert place(db, overcommit=4.0) == ("b", "p")  # the emptier pool by promise is full on disk
    heartbeat(db, "b", with_free(pool("p", 10), 1))
    with pytest.raises(InsufficientCapacity) as refused:
        place(db, overcommit=4.0)
    assert refused.value.status == 503 and refused.value.code == "InsufficientVolumeCapacity"
    assert "the pool p on a is full" in refused.value.message and "the pool p on b is full" in refused.value.message


def test_a_sqlite_database_that_cannot_grow_answers_database_full_and_keeps_what_was_committed(db: Database) -> None:
    with db.session() as s:
        s.execute(text("CREATE TABLE filler (x BLOB)"))
        s.execute(text("INSERT INTO filler VALUES ('kept')"))
    with pytest.raises(DatabaseFull) as refused, db.session() as s:
        pages = s.execute(text("PRAGMA page_count")).scalar_one()
        s.execute(text(f"PRAGMA max_page_count = {pages}"))  # as a full disk: the file cannot grow
        s.execute(text("INSERT INTO filler SELECT zeroblob(1048576) FROM (SELECT 1 UNION SELECT 2)"))
    assert refused.value.status == 503 and refused.value.code == "DatabaseFull"
    with db.read() as s:
        assert s.execute(text("SELECT x FROM filler")).scalars().all() == ["kept"]


class FakeVm:
    """A VM's monitor that answers query-status and query-block as given and records ``cont``."""

    def __init__(self, status: str, blocks: list[dict[str, Any]]) -> None:
        self.status, self.blocks, self.sent = status, blocks, []

    def cmd(self, command: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        self.sent.append(command)
        return {"query-status": {"status": self.status, "running": False}, "query-block": self.blocks}.get(command, {})


OURS = "/machine/peripheral/vbs-vol0123456789abcdef0-dev/virtio-backend"


@pytest.mark.parametrize(("status", "blocks", "resumed"), [
    ("io-error", [{"qdev": OURS, "io-status": "nospace"}, {"qdev": "/machine/peripheral/root", "io-status": "ok"}],
     True),
    ("io-error", [{"qdev": "vbs-vol0123456789abcdef0-dev", "io-status": "nospace"}], True),  # a scsi-hd: by its id
    ("paused", [{"qdev": OURS, "io-status": "nospace"}], False),  # its operator's pause
    ("io-error", [{"qdev": OURS, "io-status": "failed"}], False),  # not a lack of space
    ("io-error", [{"qdev": OURS, "io-status": "nospace"}, {"qdev": "/machine/peripheral/root",
                                                          "io-status": "nospace"}], False),  # not only ours
])
def test_only_a_vm_that_a_vbs_disk_found_full_is_resumed(status: str, blocks: list[dict[str, Any]],
                                                          resumed: bool) -> None:
    vm = FakeVm(status, blocks)
    assert _cont_if_paused_for_space(vm) is resumed  # type: ignore[arg-type]
    assert ("cont" in vm.sent) is resumed
