"""What the rbd backend and the embedded Ceph read from the Ceph tools' JSON."""

from __future__ import annotations

import json

import pytest

from vbs.ceph import pgs_all_clean
from vbs.errors import DriverError
from vbs.storage.backends.rbd import parse_listing, parse_pool_stats

pytestmark = pytest.mark.unit

VOL, VOL2, SNAP = "vol-0123456789abcdef0", "vol-0123456789abcdef1", "snap-0123456789abcdef0"


def test_listing_splits_volumes_snapshots_and_retired_images() -> None:
    text = json.dumps([
        {"image": VOL, "id": "1", "size": 1 << 30, "format": 2},
        {"image": VOL, "id": "1", "snapshot": SNAP, "snapshot_id": 4, "size": 1 << 30, "protected": "false"},
        {"image": VOL2, "size": 2 << 30, "parent": {"pool": "rbd", "image": VOL, "snapshot": SNAP}},
        {"image": f"vbs-retired-{VOL2}", "size": 1 << 30},
        {"image": "someone-elses", "size": 5},
        {"image": VOL, "snapshot": "not-ours", "size": 1},
        "garbage",
    ])
    listing = parse_listing(text)
    assert listing.volumes == {VOL: 1 << 30, VOL2: 2 << 30}
    assert listing.snapshots == {SNAP: (VOL, 1 << 30)}
    assert listing.retired == {f"vbs-retired-{VOL2}"}


def test_an_empty_pool_lists_nothing() -> None:
    assert parse_listing("").volumes == {}
    assert parse_listing("[]").snapshots == {}
    with pytest.raises(DriverError):
        parse_listing("{}")


def test_pool_stats_give_capacity_and_free_space() -> None:
    text = json.dumps({"pools": [{"name": "other", "stats": {"stored": 1, "max_avail": 2}},
                                 {"name": "rbd", "stats": {"stored": 100, "max_avail": 900}}]})
    assert parse_pool_stats(text, "rbd") == (1000, 900)
    with pytest.raises(DriverError):
        parse_pool_stats(text, "missing")


def test_pgs_are_clean_only_when_every_osd_is_up_and_every_pg_active_clean() -> None:
    status = {"osdmap": {"num_osds": 1, "num_up_osds": 1, "num_in_osds": 1},
              "pgmap": {"num_pgs": 9, "pgs_by_state": [{"state_name": "active+clean", "count": 9}]}}
    assert pgs_all_clean(status, 1)
    assert not pgs_all_clean(status, 2)
    peering = {**status, "pgmap": {"num_pgs": 9, "pgs_by_state": [{"state_name": "active+clean", "count": 8},
                                                                   {"state_name": "peering", "count": 1}]}}
    assert not pgs_all_clean(peering, 1)
    assert pgs_all_clean({**status, "pgmap": {"num_pgs": 0, "pgs_by_state": []}}, 1)
