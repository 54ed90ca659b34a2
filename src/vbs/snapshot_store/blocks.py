"""512 KiB block arithmetic over manifests: what changed-block sources give and the EBS direct APIs ask.

A block is ``BLOCK_SIZE`` (512 KiB) bytes at ``index * BLOCK_SIZE``, as EBS numbers them; a chunk
holds ``chunk_size // BLOCK_SIZE`` consecutive blocks: one, as chunks are written now; two in manifests
of 1 MiB chunks written before. ListSnapshotBlocks is ``manifest_blocks``, GetSnapshotBlock reads the
chunk of ``block_ref`` (and cuts the block out of a chunk of several), ListChangedBlocks is
``changed_blocks`` (by chunk: a block is reported changed when its chunk changed, which is exact with
one block a chunk; with several it may name an unchanged neighbour in the same chunk, never miss a
changed block).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vbs.errors import InvalidParameter
from vbs.snapshot_store.format import BLOCK_SIZE, Manifest

__all__ = ["BlockRange", "BlockRef", "block_count", "ranges_of_extents", "chunks_of_ranges", "manifest_blocks",
           "block_ref", "changed_blocks"]


@dataclass(frozen=True, order=True)
class BlockRange:
    """``count`` blocks from block ``start``: what a changed-block source reports."""

    start: int
    count: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.count <= 0:
            raise InvalidParameter(f"invalid block range {self.start}+{self.count}")

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class BlockRef:
    """Where the data of one non-zero block is: in chunk ``chunk_id`` (index ``chunk_index``) at
    ``offset`` bytes, ``length`` bytes long (less than a block only at the end of a volume)."""

    block_index: int
    chunk_index: int
    chunk_id: str
    offset: int
    length: int


def block_count(size: int) -> int:
    return -(-size // BLOCK_SIZE)


def ranges_of_extents(extents: Iterable[tuple[int, int]]) -> list[BlockRange]:
    """The blocks that byte extents ``(offset, length)`` touch (an RBD diff, the extents of a file
    that differ from its reflinked snapshot), sorted and merged."""
    spans = sorted((off // BLOCK_SIZE, -(-(off + length) // BLOCK_SIZE)) for off, length in extents if length > 0)
    merged: list[BlockRange] = []
    for start, end in spans:
        if merged and start <= merged[-1].end:
            last = merged.pop()
            merged.append(BlockRange(last.start, max(last.end, end) - last.start))
        else:
            merged.append(BlockRange(start, end - start))
    return merged


def chunks_of_ranges(ranges: Iterable[BlockRange], chunk_size: int) -> set[int]:
    """The indexes of the chunks that hold any block of ``ranges``."""
    per_chunk = _blocks_per_chunk(chunk_size)
    touched: set[int] = set()
    for r in ranges:
        touched.update(range(r.start // per_chunk, (r.end - 1) // per_chunk + 1))
    return touched


def _blocks_per_chunk(chunk_size: int) -> int:
    if chunk_size <= 0 or chunk_size % BLOCK_SIZE:
        raise InvalidParameter(f"chunk size {chunk_size} is not a whole number of {BLOCK_SIZE}-byte blocks")
    return chunk_size // BLOCK_SIZE


def _refs_of_chunk(manifest: Manifest, index: int, cid: str) -> Iterator[BlockRef]:
    per_chunk = manifest.chunk_size // BLOCK_SIZE
    length = manifest.chunk_length(index)
    for k in range(block_count(length)):
        offset = k * BLOCK_SIZE
        yield BlockRef(index * per_chunk + k, index, cid, offset, min(BLOCK_SIZE, length - offset))


def manifest_blocks(manifest: Manifest) -> Iterator[BlockRef]:
    """Every non-zero block of a snapshot, by block index."""
    for index in sorted(manifest.chunks):
        yield from _refs_of_chunk(manifest, index, manifest.chunks[index])


def block_ref(manifest: Manifest, block_index: int) -> BlockRef | None:
    """Where block ``block_index`` is, or None when it is all zeros (InvalidParameter past the end)."""
    if not 0 <= block_index < block_count(manifest.volume_size):
        raise InvalidParameter(f"block {block_index} is past the end of {manifest.snapshot_id}")
    per_chunk = manifest.chunk_size // BLOCK_SIZE
    index = block_index // per_chunk
    cid = manifest.chunks.get(index)
    if cid is None:
        return None
    offset = (block_index % per_chunk) * BLOCK_SIZE
    return BlockRef(block_index, index, cid, offset, min(BLOCK_SIZE, manifest.chunk_length(index) - offset))


def changed_blocks(before: Manifest, after: Manifest) -> Iterator[int]:
    """The blocks of ``after`` that may differ from ``before``'s, by block index (both of one
    tenant's key; blocks past the end of either count as zeros)."""
    size = max(before.volume_size, after.volume_size)
    if before.chunk_size != after.chunk_size or before.key_id != after.key_id:
        nonzero = {ref.block_index for m in (before, after) for ref in manifest_blocks(m)}
        yield from sorted(nonzero)
        return
    per_chunk = after.chunk_size // BLOCK_SIZE
    last_block = block_count(size)
    for index in sorted(set(before.chunks) | set(after.chunks)):
        if before.chunks.get(index) == after.chunks.get(index) and \
                before.chunk_length(index) == after.chunk_length(index):
            continue
        yield from range(index * per_chunk, min((index + 1) * per_chunk, last_block))
