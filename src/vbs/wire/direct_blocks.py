"""What the controller and a storage agent say to each other for the EBS direct APIs: blocks of a
snapshot written and read one at a time through the agent's snapshot store (vbs.snapshot_store.direct)."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, field_serializer

from vbs.wire.base import SnapshotId, VolumeId, Wire
from vbs.wire.storage import MAX_VOLUME_BYTES, STORE_RE, TENANT_RE, StoreKeyHex

__all__ = ["BlockWrite", "BlockWritten", "BlockRead", "BlockData", "DirectManifest", "SnapshotBlockList",
           "CHUNK_ID_RE", "BLOCK_BYTES", "MAX_BLOCK_INDEX"]

BLOCK_BYTES = 512 * 1024
MAX_BLOCK_INDEX = MAX_VOLUME_BYTES // BLOCK_BYTES - 1
CHUNK_ID_RE = r"^[0-9a-f]{64}$"
ChunkId = Annotated[str, Field(pattern=CHUNK_ID_RE)]


def _from_base64(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("not base64") from None
    return value


# One block's bytes: themselves in Python, base64 in JSON.
Block = Annotated[bytes, BeforeValidator(_from_base64),
                  PlainSerializer(lambda v: base64.b64encode(v).decode("ascii"), return_type=str, when_used="json"),
                  Field(min_length=BLOCK_BYTES, max_length=BLOCK_BYTES)]
BlockIndex = Annotated[int, Field(ge=0, le=MAX_BLOCK_INDEX, strict=True)]


class _Keyed(Wire):
    """A call that reads or writes a tenant's chunks: the store key goes with it (never kept by the agent)."""

    tenant: str = Field(pattern=TENANT_RE)
    store_key: StoreKeyHex

    @field_serializer("store_key", when_used="json")
    def _reveal(self, v: object) -> str:
        return v.get_secret_value()  # type: ignore[attr-defined, no-any-return]


class BlockWrite(_Keyed):
    """One 512 KiB block of a pending snapshot, to put into the store as a chunk."""

    data: Block


class BlockWritten(Wire):
    """The chunk that holds the block, or None: the block is all zeros (nothing stored)."""

    chunk_id: ChunkId | None


class DirectManifest(_Keyed):
    """Complete a snapshot written block by block: ``parent_snapshot_id``'s blocks (none without one) with
    ``blocks`` (index, chunk id or None for zeros) over them, ``volume_size`` bytes."""

    volume_id: VolumeId
    volume_size: int = Field(ge=BLOCK_BYTES, le=MAX_VOLUME_BYTES, strict=True)
    parent_snapshot_id: SnapshotId | None = None
    blocks: list[tuple[BlockIndex, ChunkId | None]] = Field(max_length=MAX_BLOCK_INDEX + 1)


class BlockRead(_Keyed):
    """Read block ``block_index`` of a stored snapshot."""

    block_index: BlockIndex


class BlockData(Wire):
    data: Block


class SnapshotBlockList(Wire):
    """A stored snapshot's non-zero blocks, with the chunk that holds each (equal ids: equal content),
    and the store that holds them."""

    volume_size: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)
    store: str = Field(pattern=STORE_RE)
    stored_bytes: int = Field(ge=0)
    blocks: list[tuple[BlockIndex, ChunkId]]
