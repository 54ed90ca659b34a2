"""The snapshot store's format as docs/snapshots.md writes it down, its 512 KiB block arithmetic and its
keys: what another tool reading a store, and the EBS direct APIs, rely on.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zstandard

from tests.snapshot_stores import MiB
from vbs.errors import DriverError, InvalidParameter, SnapshotDataError
from vbs.snapshot_store import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    BlockRange,
    Manifest,
    StoreKey,
    block_ref,
    changed_blocks,
    manifest_blocks,
    open_store,
    ranges_of_extents,
)
from vbs.snapshot_store.blocks import chunks_of_ranges
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.format import (
    UploadMarker,
    chunk_id,
    decode_chunk,
    decode_manifest,
    decode_marker,
    encode_chunk,
    encode_manifest,
    encode_marker,
    key_id,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
KEY = StoreKey(bytes(range(32)))
SNAP, VOL = "snap-00000000000000001", "vol-0000000000000000a"
# A chunk of two blocks (1 MiB), as manifests written before chunks became one block have: the tests of
# the block arithmetic use it where a chunk holding several blocks is what they are about.
TWO_BLOCKS = 2 * BLOCK_SIZE


def manifest(chunks: dict[int, str], size: int = 8 * MiB, **kwargs: Any) -> Manifest:
    return Manifest(SNAP, VOL, "acme", size, key_id(KEY.tenant_key("acme")), chunks,
                    datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), **kwargs)


def test_a_chunk_object_is_read_by_hand_as_the_docs_describe_it() -> None:
    """Header: magic VBSC, version 1, compression 1 (zstd), 2 zero bytes, raw length (u64 big-endian);
    then a zstd frame; the id is the HMAC-SHA256 of the plaintext under the tenant's key."""
    tenant_key = KEY.tenant_key("acme")
    data = os.urandom(1000) + bytes(CHUNK_SIZE - 1000)
    blob = encode_chunk(data)

    magic, version, compression, reserved, length = struct.unpack(">4sBBHQ", blob[:16])
    assert (magic, version, compression, reserved, length) == (b"VBSC", 1, 1, 0, CHUNK_SIZE)
    assert zstandard.ZstdDecompressor().decompress(blob[16:]) == data
    assert hmac.new(tenant_key, data, "sha256").hexdigest() == chunk_id(tenant_key, data)
    assert decode_chunk(blob, tenant_key, chunk_id(tenant_key, data)) == data
    assert len(blob) < 2000  # compressed


def test_data_zstd_cannot_shrink_is_stored_as_it_is() -> None:
    tenant_key = KEY.tenant_key("acme")
    data = os.urandom(CHUNK_SIZE)  # as an encrypted volume's ciphertext
    blob = encode_chunk(data)

    assert struct.unpack(">4sBBHQ", blob[:16]) == (b"VBSC", 1, 0, 0, CHUNK_SIZE) and blob[16:] == data
    assert decode_chunk(blob, tenant_key, chunk_id(tenant_key, data)) == data


def test_a_manifest_is_zstd_json_another_tool_can_read() -> None:
    m = manifest({0: "a" * 64, 5: "b" * 64}, parent_snapshot_id="snap-00000000000000000")
    blob = encode_manifest(m)

    assert blob[:6] == b"VBSM\x01\x01"
    doc = json.loads(zstandard.ZstdDecompressor().decompress(blob[16:]))
    assert doc == {
        "format": "vbs-snapshot-manifest", "format_version": 1, "snapshot_id": SNAP, "volume_id": VOL,
        "tenant": "acme", "volume_size": 8 * MiB, "block_size": 524288, "chunk_size": 524288,
        "hash": "hmac-sha256", "key_id": m.key_id, "parent_snapshot_id": "snap-00000000000000000",
        "created_at": "2026-01-02T03:04:05.000000Z", "chunks": [[0, "a" * 64], [5, "b" * 64]],
    }
    assert decode_manifest(blob, SNAP) == m


def test_an_upload_marker_carries_abandoned_at_only_once_abandoned() -> None:
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    live = UploadMarker(SNAP, VOL, "acme", started, frozenset({"a" * 64}))
    abandoned = UploadMarker(SNAP, VOL, "acme", started, abandoned_at=datetime(2026, 1, 3, tzinfo=UTC))

    def doc(marker: UploadMarker) -> dict[str, Any]:
        blob = encode_marker(marker)
        assert blob[:4] == b"VBSU" and decode_marker(blob, SNAP) == marker
        raw = zstandard.ZstdDecompressor().decompress(blob[16:]) if blob[5] == 1 else blob[16:]
        loaded: dict[str, Any] = json.loads(raw)
        return loaded

    assert "abandoned_at" not in doc(live) and doc(live)["claims"] == ["a" * 64]
    assert doc(abandoned)["abandoned_at"] == "2026-01-03T00:00:00.000000Z" and doc(abandoned)["claims"] == []


@pytest.mark.parametrize("damage", ["bit", "version", "index", "stored as another"])
def test_a_damaged_manifest_is_an_error_naming_the_snapshot(damage: str) -> None:
    m = manifest({0: "a" * 64})
    if damage == "bit":
        blob = bytearray(encode_manifest(m))
        blob[30] ^= 0x10
    elif damage == "version":
        blob = bytearray(encode_manifest(m))
        blob[4] = 2
    elif damage == "index":  # the last chunk's index made one past the end
        last = m.chunk_count - 1
        blob = bytearray(encode_manifest(manifest({last: "a" * 64})))
        blob = bytearray(encode_manifest(m)[:16]) + zstandard.ZstdCompressor().compress(
            zstandard.ZstdDecompressor().decompress(bytes(blob[16:])).replace(f"[[{last},".encode(),
                                                                              f"[[{last + 1},".encode()))
        blob[8:16] = struct.pack(">Q", len(zstandard.ZstdDecompressor().decompress(bytes(blob[16:]))))
    else:
        blob = bytearray(encode_manifest(m))

    with pytest.raises(SnapshotDataError, match=SNAP if damage != "stored as another" else "snap-00000000000000009"):
        decode_manifest(bytes(blob), SNAP if damage != "stored as another" else "snap-00000000000000009")


def test_chunk_sizes_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="whole number"):
        manifest({}, chunk_size=3 * 1024 * 1024 // 2 - 4096).check()
    assert manifest({}, chunk_size=4 * MiB).chunk_count == 2


def test_byte_extents_become_merged_block_ranges() -> None:
    extents = [(0, 1), (BLOCK_SIZE - 1, 2), (10 * BLOCK_SIZE, BLOCK_SIZE), (3 * BLOCK_SIZE, 0), (11 * BLOCK_SIZE, 5)]

    assert ranges_of_extents(extents) == [BlockRange(0, 2), BlockRange(10, 2)]
    assert chunks_of_ranges([BlockRange(0, 2), BlockRange(10, 2)], CHUNK_SIZE) == {0, 1, 10, 11}  # a chunk a block
    assert chunks_of_ranges([BlockRange(0, 2), BlockRange(10, 2)], TWO_BLOCKS) == {0, 5}
    assert chunks_of_ranges([BlockRange(1, 2)], TWO_BLOCKS) == {0, 1}


def test_blocks_of_a_manifest_are_its_non_zero_512k_blocks() -> None:
    m = manifest({0: "a" * 64, 3: "b" * 64}, size=3 * BLOCK_SIZE + 4096)  # chunk 3 is 4 KiB

    refs = list(manifest_blocks(m))

    assert [(r.block_index, r.chunk_index, r.offset, r.length) for r in refs] == [
        (0, 0, 0, BLOCK_SIZE), (3, 3, 0, 4096)]
    assert block_ref(m, 1) is None and block_ref(m, 3) == refs[-1]
    with pytest.raises(InvalidParameter):
        block_ref(m, 4)


def test_blocks_of_a_manifest_of_two_block_chunks_are_cut_out_of_them() -> None:
    m = manifest({0: "a" * 64, 3: "b" * 64}, size=3 * MiB + BLOCK_SIZE + 4096,
                 chunk_size=TWO_BLOCKS)  # chunk 3 is 516 KiB

    refs = list(manifest_blocks(m))

    assert [(r.block_index, r.chunk_index, r.offset, r.length) for r in refs] == [
        (0, 0, 0, BLOCK_SIZE), (1, 0, BLOCK_SIZE, BLOCK_SIZE), (6, 3, 0, BLOCK_SIZE), (7, 3, BLOCK_SIZE, 4096)]
    assert block_ref(m, 2) is None and block_ref(m, 7) == refs[-1]
    with pytest.raises(InvalidParameter):
        block_ref(m, 8)


def test_changed_blocks_between_two_manifests_are_exactly_the_changed_blocks() -> None:
    """A chunk is one block: ListChangedBlocks names every changed block and no unchanged one."""
    before = manifest({0: "a" * 64, 1: "b" * 64, 2: "c" * 64, 5: "f" * 64})
    after = manifest({0: "a" * 64, 1: "d" * 64, 3: "e" * 64, 5: "f" * 64})

    assert list(changed_blocks(before, after)) == [1, 2, 3]  # rewritten, zeroed, written
    assert list(changed_blocks(before, before)) == []


def test_changed_blocks_between_manifests_of_two_block_chunks_are_those_of_changed_chunks() -> None:
    before = manifest({0: "a" * 64, 1: "b" * 64, 2: "c" * 64}, chunk_size=TWO_BLOCKS)
    after = manifest({0: "a" * 64, 1: "d" * 64, 3: "e" * 64}, chunk_size=TWO_BLOCKS)

    assert list(changed_blocks(before, after)) == [2, 3, 4, 5, 6, 7]  # both blocks of each changed chunk
    assert list(changed_blocks(before, before)) == []


def test_changed_blocks_against_a_manifest_of_two_block_chunks_are_every_non_zero_block_of_either() -> None:
    """Ids of chunks of different sizes cannot be compared: every block either snapshot holds is named."""
    before = manifest({0: "a" * 64, 2: "c" * 64}, chunk_size=TWO_BLOCKS)  # blocks 0, 1, 4, 5
    after = manifest({1: "b" * 64, 7: "e" * 64})

    assert list(changed_blocks(before, after)) == [0, 1, 4, 5, 7]


def test_tenant_keys_differ_and_the_key_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "snapshot-store.key"
    key = StoreKey.load_or_create(path)

    assert path.stat().st_mode & 0o777 == 0o600
    assert StoreKey.load_or_create(path).tenant_key("acme") == key.tenant_key("acme")
    assert key.tenant_key("acme") != key.tenant_key("globex")
    assert path.read_text().strip() not in repr(key)
    path.chmod(0o644)
    with pytest.raises(DriverError, match="read by others"):
        StoreKey.load(path)


def test_a_store_refuses_an_agent_with_another_key(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "store")
    open_store(store, KEY)
    open_store(store, KEY)

    with pytest.raises(DriverError, match="another store key"):
        open_store(store, StoreKey(bytes(32)))
