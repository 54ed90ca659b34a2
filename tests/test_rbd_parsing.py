"""What the rbd backend and the embedded Ceph read from the Ceph tools' JSON."""

from __future__ import annotations

import json

import pytest

from vbs.errors import DriverError
from vbs.rigs.ceph import pgs_all_clean
from vbs.storage.backends.rbd import Listing, parse_listing, parse_pool_stats
from vbs.storage.backends.rbd_chains import (
    TrashEntry,
    parse_flatten_progress,
    parse_parent,
    parse_snaps,
    parse_trash,
    parse_watchers,
)
from vbs.wire.storage import MAX_CHAIN_DEPTH

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
    assert listing.has_clones(VOL) and not listing.has_clones(VOL2), "a clone reads from a snapshot of VOL"


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


# -- the trash, clone chains and flattens: outputs captured from Debian's Ceph 16.2 ----------------

TRASH_ID = "106ecf0aa77b"
TRASH_LS = '[{"id":"106ecf0aa77b","name":"vol-0123456789abcdef0"},{"id":"1a2b","name":"not-ours"}]'
SNAP_LS_OF_TRASHED = (
    '[{"id":8,"name":"8237c508-5d1a-4fe3-bcbf-0f1e0920b74b","size":8388608,"protected":"false",'
    '"timestamp":"Mon Nov 23 21:01:51 2026","namespace":{"type":"trash","original_name":"snap-0123456789abcdef0"}},'
    '{"id":9,"name":"snap-0123456789abcdef1","size":8388608,"protected":"false",'
    '"timestamp":"Mon Nov 23 21:01:51 2026","namespace":{"type":"user"}}]')
INFO_OF_CLONE_OF_TRASHED = (
    '{"name":"vol-0123456789abcdef1","id":"10742cb01a96","size":8388608,"objects":2,"order":22,'
    '"object_size":4194304,"snapshot_count":0,"block_name_prefix":"rbd_data.10742cb01a96","format":2,'
    '"features":["layering","exclusive-lock","object-map","fast-diff","deep-flatten","operations"],'
    '"op_features":["clone-child"],"flags":[],"parent":{"pool":"p","pool_namespace":"",'
    '"image":"vol-0123456789abcdef0","id":"106ecf0aa77b","snapshot":"8237c508-5d1a-4fe3-bcbf-0f1e0920b74b",'
    '"trash":true,"overlap":8388608}}')
LS_WITH_A_TRASHED_PARENT = (
    '[{"image":"vol-0123456789abcdef1","id":"10742cb01a96","size":8388608,"parent":{"pool":"p",'
    '"pool_namespace":"","image":"vol-0123456789abcdef0","snapshot":"8237c508-5d1a-4fe3-bcbf-0f1e0920b74b"},'
    '"format":2},{"image":"vol-c","id":"10569cadec75","size":67108864,"format":2}]')
# What `rbd flatten` writes to a pipe: carriage returns, no newline until "done."
FLATTEN_STDERR = (b"\rImage flatten: 6% complete...\rImage flatten: 12% complete...\rImage flatten: 18% complete..."
                  b"\rImage flatten: 100% complete...done.\n")


def test_the_trash_lists_only_images_of_vbs_by_id() -> None:
    entries = parse_trash(TRASH_LS)
    assert [(e.id, e.name) for e in entries] == [(TRASH_ID, VOL)]
    assert parse_trash("") == []
    with pytest.raises(DriverError):
        parse_trash('{"id": "x"}')


def test_a_trashed_image_is_kept_for_its_live_snapshots_then_for_the_clones_of_deleted_ones() -> None:
    entry = TrashEntry(id=TRASH_ID, name=VOL, snaps=parse_snaps(SNAP_LS_OF_TRASHED))
    assert [(s.name, s.trashed) for s in entry.snaps] == [("8237c508-5d1a-4fe3-bcbf-0f1e0920b74b", True),
                                                            ("snap-0123456789abcdef1", False)]
    assert entry.kept_for == "snapshots"
    entry.snaps = [s for s in entry.snaps if s.trashed]
    assert entry.kept_for == "children"
    entry.snaps = []
    assert entry.kept_for == "nothing"


def test_the_parent_of_a_clone_says_whether_it_is_trashed() -> None:
    info = json.loads(INFO_OF_CLONE_OF_TRASHED)
    assert parse_parent(info) == (VOL, "8237c508-5d1a-4fe3-bcbf-0f1e0920b74b", TRASH_ID)
    info["parent"]["trash"] = False
    assert parse_parent(info) == (VOL, "8237c508-5d1a-4fe3-bcbf-0f1e0920b74b", None)
    assert parse_parent({"size": 1}) is None
    assert parse_parent({"parent": {"image": 3}}) is None


def test_a_listing_knows_the_chains_through_the_trash() -> None:
    listing = parse_listing(LS_WITH_A_TRASHED_PARENT)
    assert listing.volumes == {VOL2: 8388608}
    assert listing.parents == {VOL2: (VOL, "8237c508-5d1a-4fe3-bcbf-0f1e0920b74b")}
    trashed = TrashEntry(id=TRASH_ID, name=f"vbs-retired-{VOL}", snaps=parse_snaps(SNAP_LS_OF_TRASHED),
                         parent=("vol-0123456789abcdef2", SNAP))
    listing.add_trashed(trashed)
    listing.parents[VOL] = (f"vbs-retired-{VOL}", "snap-0123456789abcdef1")
    assert listing.snapshots["snap-0123456789abcdef1"] == (f"vbs-retired-{VOL}", 8388608)
    assert "8237c508-5d1a-4fe3-bcbf-0f1e0920b74b" not in listing.snapshots  # deleted ones are not VBS's
    assert listing.chain(VOL) == [f"vbs-retired-{VOL}@snap-0123456789abcdef1", f"vol-0123456789abcdef2@{SNAP}"]
    assert listing.depth(VOL) == 2
    assert listing.depth("vol-0123456789abcdef2") == 0
    assert listing.has_clones(f"vbs-retired-{VOL}") and listing.has_clones("vol-0123456789abcdef2")
    assert not listing.has_clones(VOL2)


def test_a_chain_that_loops_is_cut_at_the_deepest_chain_reported() -> None:
    listing = Listing(parents={VOL: (VOL2, SNAP), VOL2: (VOL, SNAP)})
    assert listing.depth(VOL) == MAX_CHAIN_DEPTH


def test_flatten_progress_is_the_last_percentage_on_stderr() -> None:
    assert parse_flatten_progress(FLATTEN_STDERR) == 100
    assert parse_flatten_progress(FLATTEN_STDERR[:60]) == 12
    assert parse_flatten_progress(b"") is None
    assert parse_flatten_progress(b"\rImage flatten: 37% comp") is None
    assert parse_flatten_progress(b"\rImage flatten: 37% complete...\rImage flat") == 37


def test_watchers_are_the_clients_that_have_an_image_open() -> None:
    assert parse_watchers('{"watchers":[{"address":"127.0.0.1:0/29289245","client":4270,'
                          '"cookie":94624386240016}]}') == 1
    assert parse_watchers('{"watchers":[]}') == 0
    with pytest.raises(DriverError):
        parse_watchers("[]")
