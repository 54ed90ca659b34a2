"""The snapshot store's format, version 1: object keys, chunks, manifests (docs/snapshots.md).

Everything here is pure: bytes in, bytes out, no store. Another tool that reads a store needs only
what this module does, and docs/snapshots.md says it in words.

- A chunk is ``CHUNK_SIZE`` bytes of a volume (the last one may be shorter), named by its id: the
  HMAC-SHA256 of its plaintext under the tenant's key, in hex. All-zero chunks are not stored.
- Every object VBS writes starts with a 16-byte header: magic (``VBSC`` a chunk, ``VBSM`` a
  manifest, ``VBSU`` an upload marker), the format version, the compression (0 none, 1 zstd), two
  reserved zero bytes and the raw (uncompressed) length as an unsigned 64-bit big-endian number.
  zstd frames carry their content checksum, so a damaged compressed object is caught on
  decompression even without the tenant's key. Data zstd cannot shrink is stored as it is.
- A manifest is JSON listing every non-zero chunk of one snapshot; see ``Manifest``.
"""

from __future__ import annotations

import hmac
import json
import re
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import zstandard

from vbs import ids
from vbs.errors import InvalidParameter, SnapshotDataError

__all__ = [
    "FORMAT_VERSION", "BLOCK_SIZE", "CHUNK_SIZE", "Manifest", "UploadMarker", "chunk_id", "key_id",
    "encode_chunk", "decode_chunk", "is_whole_chunk", "encode_manifest", "decode_manifest", "encode_marker",
    "decode_marker", "chunk_key", "manifest_key", "marker_key", "CHUNKS", "MANIFESTS", "UPLOADS", "check_tenant",
]

FORMAT_VERSION = 1
# The EBS block: what the EBS direct APIs index and checksum (ListSnapshotBlocks, GetSnapshotBlock, …).
BLOCK_SIZE = 512 * 1024
# What one chunk object holds: one EBS block, so a change costs only the blocks it touches and the EBS
# direct APIs map onto chunks one to one (docs/snapshots.md, "Why 512 KiB chunks"). Manifests written
# before hold 1 MiB chunks (two blocks): each records its chunk size.
CHUNK_SIZE = 512 * 1024
# Readers accept any whole number of blocks up to this, so a writer may choose another size.
MAX_CHUNK_SIZE = 64 * 1024 * 1024

CHUNKS = "chunks/"
MANIFESTS = "manifests/"
UPLOADS = "uploads/"

_HEADER = struct.Struct(">4sBBHQ")
_MAGIC_CHUNK, _MAGIC_MANIFEST, _MAGIC_MARKER = b"VBSC", b"VBSM", b"VBSU"
_NONE, _ZSTD = 0, 1
# Level 1, as Proxmox Backup Server uses for VM images: the agent's CPU also serves its volumes.
_ZSTD_LEVEL = 1
_SAMPLE = 16 * 1024
_ID_RE = re.compile(r"[0-9a-f]{64}")
TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

_T = TypeVar("_T")

# zstd contexts are not thread-safe; uploads and restores run many threads, each with its own.
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        raise InvalidParameter(f"invalid tenant {str(tenant)[:80]!r}")
    return tenant


def is_chunk_id(value: object) -> bool:
    return isinstance(value, str) and bool(_ID_RE.fullmatch(value))


# -- keys ------------------------------------------------------------------------------------------


def chunk_key(cid: str) -> str:
    """``chunks/<first two hex digits>/<id>``: 256 fan-out directories (or S3 key ranges)."""
    if not is_chunk_id(cid):
        raise InvalidParameter(f"invalid chunk id {cid[:80]!r}")
    return f"{CHUNKS}{cid[:2]}/{cid}"


def manifest_key(snapshot_id: str) -> str:
    return MANIFESTS + ids.check("snapshot", snapshot_id)


def marker_key(snapshot_id: str) -> str:
    return UPLOADS + ids.check("snapshot", snapshot_id)


# -- chunks ----------------------------------------------------------------------------------------


def chunk_id(tenant_key: bytes, data: bytes | memoryview) -> str:
    """The id of a chunk whose plaintext is ``data``: HMAC-SHA256 under the tenant's key, hex."""
    return hmac.digest(tenant_key, data, "sha256").hex()


def key_id(tenant_key: bytes) -> str:
    """A fingerprint of a tenant key, kept in its manifests: a reader holding another key is told so
    instead of finding every chunk corrupt. It reveals nothing of the key."""
    return hmac.digest(tenant_key, b"vbs-snapshot-store key id", "sha256").hex()[:16]


def _frame(magic: bytes, raw: bytes | memoryview, *, compress: bool = True) -> bytes:
    method = _ZSTD if compress and _compressible(raw) else _NONE
    body = _compressor().compress(raw) if method == _ZSTD else bytes(raw)
    return _HEADER.pack(magic, FORMAT_VERSION, method, 0, len(raw)) + body


def _compressible(raw: bytes | memoryview) -> bool:
    """Whether zstd would gain anything: it is tried on four 16 KiB samples first, so that data that
    does not compress (an encrypted volume's ciphertext, media) costs a sixteenth of compressing it."""
    if len(raw) < 4 * _SAMPLE:
        return True
    view = memoryview(raw)
    step = len(raw) // 4
    sample = b"".join(view[i * step:i * step + _SAMPLE] for i in range(4))
    return len(_compressor().compress(sample)) < 0.97 * len(sample)


def _unframe(magic: bytes, blob: bytes, what: str) -> bytes:
    """The raw bytes of an object, or ``ValueError`` saying what is wrong with it."""
    if len(blob) < _HEADER.size:
        raise ValueError(f"{what} is {len(blob)} bytes, shorter than its header")
    found, version, method, _reserved, length = _HEADER.unpack_from(blob)
    if found != magic:
        raise ValueError(f"{what} does not start with {magic.decode()}")
    if version != FORMAT_VERSION:
        raise ValueError(f"{what} has format version {version}; this VBS reads version {FORMAT_VERSION}")
    body = memoryview(blob)[_HEADER.size:]
    if method == _NONE:
        raw = bytes(body)
    elif method == _ZSTD:
        try:
            raw = _decompressor().decompress(body, max_output_size=length)
        except zstandard.ZstdError as exc:
            raise ValueError(f"{what} does not decompress: {exc}") from None
    else:
        raise ValueError(f"{what} has unknown compression {method}")
    if len(raw) != length:
        raise ValueError(f"{what} holds {len(raw)} bytes, its header says {length}")
    return raw


def encode_chunk(data: bytes | memoryview) -> bytes:
    return _frame(_MAGIC_CHUNK, data)


def decode_chunk(blob: bytes, tenant_key: bytes, cid: str, *, length: int | None = None) -> bytes:
    """The plaintext of chunk ``cid``, checked: it decodes, has ``length`` bytes if given, and hashes
    to its id. ``ValueError`` says what is wrong (callers name the snapshot and raise ChunkCorrupt)."""
    raw = _unframe(_MAGIC_CHUNK, blob, "the chunk")
    if length is not None and len(raw) != length:
        raise ValueError(f"the chunk holds {len(raw)} bytes, the manifest expects {length}")
    if not hmac.compare_digest(chunk_id(tenant_key, raw), cid):
        raise ValueError("the chunk's bytes do not hash to its id")
    return raw


def is_whole_chunk(blob: bytes, tenant_key: bytes, cid: str, length: int) -> bool:
    """Whether ``blob`` is chunk ``cid`` of ``length`` bytes, whole: what ``decode_chunk`` (a restore's
    check) accepts. An empty or short object, one cut by a power cut, is not."""
    try:
        decode_chunk(blob, tenant_key, cid, length=length)
    except ValueError:
        return False
    return True


# -- manifests -------------------------------------------------------------------------------------


def _utc_text(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: object) -> datetime:
    if not isinstance(text, str):
        raise ValueError("a time is not a string")
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


@dataclass(frozen=True)
class Manifest:
    """Everything needed to restore one snapshot, and nothing of any other.

    ``chunks`` maps a chunk's index (its offset divided by ``chunk_size``) to its id; an index that
    is not there is all zeros. The last chunk of a volume whose size is not a whole number of chunks
    is shorter (``volume_size - index * chunk_size`` bytes).
    """

    snapshot_id: str
    volume_id: str
    tenant: str
    volume_size: int
    key_id: str
    chunks: Mapping[int, str]
    created_at: datetime
    parent_snapshot_id: str | None = None
    chunk_size: int = CHUNK_SIZE
    block_size: int = BLOCK_SIZE
    format_version: int = FORMAT_VERSION

    @property
    def chunk_count(self) -> int:
        return -(-self.volume_size // self.chunk_size)

    def chunk_length(self, index: int) -> int:
        return min(self.chunk_size, self.volume_size - index * self.chunk_size)

    def chunk_ids(self) -> set[str]:
        return set(self.chunks.values())

    def check(self) -> Manifest:
        """This manifest if it is consistent, else ``ValueError`` saying why."""
        ids.check("snapshot", self.snapshot_id)
        ids.check("volume", self.volume_id)
        check_tenant(self.tenant)
        if self.parent_snapshot_id is not None:
            ids.check("snapshot", self.parent_snapshot_id)
        if self.block_size != BLOCK_SIZE:
            raise ValueError(f"block size {self.block_size}, not {BLOCK_SIZE}")
        if not (0 < self.chunk_size <= MAX_CHUNK_SIZE and self.chunk_size % BLOCK_SIZE == 0):
            raise ValueError(f"chunk size {self.chunk_size} is not a whole number of {BLOCK_SIZE}-byte blocks")
        if self.volume_size <= 0 or self.volume_size % 512:
            raise ValueError(f"volume size {self.volume_size} is not a positive whole number of sectors")
        count = self.chunk_count
        for index, cid in self.chunks.items():
            if not (0 <= index < count) or not is_chunk_id(cid):
                raise ValueError(f"chunk entry {index}: {str(cid)[:80]!r} is not an index below {count} and an id")
        return self


def _encode_document(magic: bytes, doc: dict[str, Any]) -> bytes:
    return _frame(magic, json.dumps(doc, separators=(",", ":")).encode())


def _decode_document(magic: bytes, blob: bytes, kind: str, what: str, snapshot_id: str,
                     build: Callable[[dict[str, Any]], _T]) -> _T:
    """``build`` of the ``kind`` JSON document framed in ``blob``; ``SnapshotDataError`` saying that
    ``what`` of ``snapshot_id`` is damaged if the frame, the JSON or what ``build`` checks is wrong."""
    try:
        doc = json.loads(_unframe(magic, blob, what))
        if not isinstance(doc, dict) or doc.get("format") != kind:
            raise ValueError(f"{what} is not a {kind} document")
        return build(doc)
    except (ValueError, KeyError, TypeError, InvalidParameter) as exc:
        reason = exc.message if isinstance(exc, InvalidParameter) else str(exc)
        raise SnapshotDataError(f"{what} of {snapshot_id} is damaged: {reason}", snapshot_id=snapshot_id) from None


def encode_manifest(manifest: Manifest) -> bytes:
    manifest.check()
    doc = {
        "format": "vbs-snapshot-manifest",
        "format_version": manifest.format_version,
        "snapshot_id": manifest.snapshot_id,
        "volume_id": manifest.volume_id,
        "tenant": manifest.tenant,
        "volume_size": manifest.volume_size,
        "block_size": manifest.block_size,
        "chunk_size": manifest.chunk_size,
        "hash": "hmac-sha256",
        "key_id": manifest.key_id,
        "parent_snapshot_id": manifest.parent_snapshot_id,
        "created_at": _utc_text(manifest.created_at),
        "chunks": [[index, manifest.chunks[index]] for index in sorted(manifest.chunks)],
    }
    return _encode_document(_MAGIC_MANIFEST, doc)


def decode_manifest(blob: bytes, snapshot_id: str) -> Manifest:
    """The manifest of ``snapshot_id`` from its object; ``SnapshotDataError`` naming it if it is damaged."""
    manifest = _decode_document(_MAGIC_MANIFEST, blob, "vbs-snapshot-manifest", "the manifest", snapshot_id,
                                _manifest_of)
    if manifest.snapshot_id != snapshot_id:
        raise SnapshotDataError(f"the manifest stored as {snapshot_id} is {manifest.snapshot_id}'s",
                                snapshot_id=snapshot_id)
    return manifest


def _manifest_of(doc: dict[str, Any]) -> Manifest:
    if doc.get("hash") != "hmac-sha256":
        raise ValueError(f"the manifest's chunk ids are {doc.get('hash')!r}, not hmac-sha256")
    chunks: dict[int, str] = {}
    for entry in doc["chunks"]:
        index, cid = entry
        if not isinstance(index, int) or index in chunks:
            raise ValueError(f"chunk entry {str(entry)[:80]} repeats or is not an index")
        chunks[index] = cid
    return Manifest(
        snapshot_id=doc["snapshot_id"], volume_id=doc["volume_id"], tenant=doc["tenant"],
        volume_size=int(doc["volume_size"]), key_id=str(doc["key_id"]), chunks=chunks,
        created_at=_parse_time(doc["created_at"]), parent_snapshot_id=doc.get("parent_snapshot_id"),
        chunk_size=int(doc["chunk_size"]), block_size=int(doc["block_size"]),
        format_version=int(doc["format_version"]),
    ).check()


# -- upload markers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class UploadMarker:
    """An upload in flight: written before its first chunk, with the ids of every chunk its manifest
    will list once it knows them (``claims``), deleted after the manifest is written. Garbage
    collection keeps every chunk a marker claims (docs/snapshots.md, "Garbage collection").

    The marker of an upload given up unfinished (its snapshot deleted) stays ``abandoned_at`` then, with
    no claims, until a collection has swept what it may have left unsynced (docs/snapshots.md,
    "Durability")."""

    snapshot_id: str
    volume_id: str
    tenant: str
    started_at: datetime
    claims: frozenset[str] = field(default_factory=frozenset)
    abandoned_at: datetime | None = None


def encode_marker(marker: UploadMarker) -> bytes:
    doc = {
        "format": "vbs-snapshot-upload",
        "format_version": FORMAT_VERSION,
        "snapshot_id": ids.check("snapshot", marker.snapshot_id),
        "volume_id": ids.check("volume", marker.volume_id),
        "tenant": check_tenant(marker.tenant),
        "started_at": _utc_text(marker.started_at),
        "claims": sorted(marker.claims),
    }
    if marker.abandoned_at is not None:
        doc["abandoned_at"] = _utc_text(marker.abandoned_at)
    return _encode_document(_MAGIC_MARKER, doc)


def decode_marker(blob: bytes, snapshot_id: str) -> UploadMarker:
    return _decode_document(_MAGIC_MARKER, blob, "vbs-snapshot-upload", "the upload marker", snapshot_id,
                            _marker_of)


def _marker_of(doc: dict[str, Any]) -> UploadMarker:
    claims = doc["claims"]
    if not isinstance(claims, list) or not all(is_chunk_id(c) for c in claims):
        raise ValueError("the upload marker's claims are not chunk ids")
    return UploadMarker(snapshot_id=ids.check("snapshot", doc["snapshot_id"]),
                        volume_id=ids.check("volume", doc["volume_id"]), tenant=check_tenant(doc["tenant"]),
                        started_at=_parse_time(doc["started_at"]), claims=frozenset(claims),
                        abandoned_at=_parse_time(doc["abandoned_at"]) if "abandoned_at" in doc else None)


def json_object(blob: bytes) -> dict[str, Any]:
    """A small plain-JSON object (the store's identity, the GC's state); ``ValueError`` if it is not one."""
    doc = json.loads(blob)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc
