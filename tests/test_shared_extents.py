"""The comparison of two files' extent maps (``vbs.system.shared_extents``, docs/snapshots.md "Incremental
uploads"): only what both certainly share, or both leave as holes, is unchanged. The same on real
reflinked files of an XFS: tests/test_reflink_changed_extents.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vbs.system.shared_extents import EXTENT_LAST, EXTENT_SHARED, Extent, changed_extents, changed_of_maps

pytestmark = pytest.mark.unit

K = 1 << 10
SH = EXTENT_SHARED
UNWRITTEN, DELALLOC, UNKNOWN, ENCODED, INLINE = 0x800, 0x4, 0x2, 0x8, 0x200


def ext(logical: int, physical: int, length: int, flags: int = SH) -> Extent:
    return Extent(logical * K, physical * K, length * K, flags)


def changed(older: list[Extent], newer: list[Extent], older_kib: int = 64,
            newer_kib: int = 64) -> list[tuple[int, int]]:
    return [(off // K, length // K) for off, length in changed_of_maps(older, newer, older_kib * K, newer_kib * K)]


def test_the_same_shared_blocks_and_holes_in_both_are_unchanged() -> None:
    both = [ext(0, 1000, 16), ext(32, 2000, 8, SH | EXTENT_LAST)]
    assert changed(both, both) == []
    # One extent of the older file split in two in the newer (the same blocks): still unchanged.
    assert changed([ext(0, 1000, 16)], [ext(0, 1000, 4), ext(4, 1004, 12, SH | EXTENT_LAST)]) == []


def test_other_blocks_or_one_side_only_are_changed() -> None:
    older = [ext(0, 1000, 16), ext(32, 2000, 8)]
    # 4 KiB at 8 KiB moved to other blocks (copy on write), 8 KiB at 40 KiB punched out in the newer.
    newer = [ext(0, 1000, 8), ext(8, 5000, 4, 0), ext(12, 1012, 4), ext(32, 2000, 8)]
    assert changed(older, newer) == [(8, 4)]
    assert changed(older, [ext(0, 1000, 16)]) == [(32, 8)]  # a hole in the newer only
    assert changed([ext(0, 1000, 16)], older) == [(32, 8)]  # data in the newer only
    # The same physical offset for another logical offset is not the same bytes.
    assert changed([ext(0, 1000, 16)], [ext(0, 1004, 16)]) == [(0, 16)]


@pytest.mark.parametrize("flag", [UNWRITTEN, DELALLOC, UNKNOWN, ENCODED, INLINE, 0])
def test_an_uncertain_or_unshared_mapping_is_changed_even_at_the_same_blocks(flag: int) -> None:
    certain = [ext(0, 1000, 16)]
    doubtful = [ext(0, 1000, 16, flag | (SH if flag else 0))]
    assert changed(certain, doubtful) == [(0, 16)]
    assert changed(doubtful, certain) == [(0, 16)]


def test_beyond_the_older_end_everything_is_changed() -> None:
    older = [ext(0, 1000, 16)]
    assert changed(older, [ext(0, 1000, 16)], older_kib=16, newer_kib=64) == [(16, 48)]
    # An extent that runs past the older file's end counts only up to it.
    assert changed([ext(0, 1000, 32)], [ext(0, 1000, 32)], older_kib=16, newer_kib=64) == [(16, 48)]
    # A shrunken file (not a volume's, which only grows) is compared up to its own end.
    assert changed(older, older, older_kib=64, newer_kib=8) == []


def test_two_copies_of_the_same_bytes_are_never_unchanged(tmp_path: Path) -> None:
    # Whatever file system the test runs on: copies (no reflink) share no blocks, or it gives no map (tmpfs).
    data = os.urandom(1 << 20)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data)
    with (tmp_path / "a").open("rb") as a, (tmp_path / "b").open("rb") as b:
        assert changed_extents(a.fileno(), b.fileno()) in (None, [(0, 1 << 20)])
