"""Block tokens and page tokens of the EBS direct APIs.

A **block token** (ListSnapshotBlocks, ListChangedBlocks) lets its holder read one block of one snapshot
until it expires (GetSnapshotBlock): base64 of ``<snapshot id>|<block index>|<expiry, unix s>`` and an
HMAC-SHA256 (cut to 16 bytes) of it under a key derived from the snapshot store's key, which every
controller of the install holds. A token of another snapshot or block, an expired one, a forged or cut
one: each is refused with the same ``INVALID_BLOCK_TOKEN``.

A **page token** (``NextToken``) is where the next page starts: base64 of ``<snapshot id>|<block index>``,
checked against the request it comes back with (a token of another listing is ``INVALID_PAGE_TOKEN``).
It grants nothing, so it is not signed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re

from vbs.controller.ebs.errors import Validation

__all__ = ["BlockTokens", "page_token", "page_start"]

_MAC_BYTES = 16
_BLOCK_RE = re.compile(r"(snap-[0-9a-f]{17})\|([0-9]{1,12})\|([0-9]{1,12})")
_PAGE_RE = re.compile(r"(snap-[0-9a-f]{17})\|([0-9]{1,12})")
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9+/=]{1,256}")


def _decoded(token: str) -> bytes | None:
    if not _TOKEN_CHARS.fullmatch(token):
        return None
    try:
        return base64.b64decode(token, validate=True)
    except (binascii.Error, ValueError):
        return None


class BlockTokens:
    def __init__(self, store_key_hex: str) -> None:
        self._key = hmac.digest(bytes.fromhex(store_key_hex), b"vbs ebs block token", "sha256")

    def _mac(self, payload: bytes) -> bytes:
        return hmac.digest(self._key, payload, "sha256")[:_MAC_BYTES]

    def make(self, snapshot_id: str, block_index: int, expires: int) -> str:
        payload = f"{snapshot_id}|{block_index}|{expires}".encode()
        return base64.b64encode(payload + self._mac(payload)).decode("ascii")

    def check(self, token: str, snapshot_id: str, block_index: int, now: float) -> None:
        """Nothing if ``token`` lets its holder read ``block_index`` of ``snapshot_id`` now, else
        ``ValidationException`` (``INVALID_BLOCK_TOKEN``)."""
        raw = _decoded(token)
        ok = raw is not None and len(raw) > _MAC_BYTES
        payload, mac = (raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]) if ok and raw is not None else (b"", b"")
        ok = ok and hmac.compare_digest(self._mac(payload), mac)
        match = _BLOCK_RE.fullmatch(payload.decode("ascii", "replace")) if ok else None
        if match is None or match.group(1) != snapshot_id or int(match.group(2)) != block_index:
            raise Validation("The block token is not valid for this snapshot and block.", "INVALID_BLOCK_TOKEN")
        if int(match.group(3)) < now:
            raise Validation("The block token has expired: list the blocks again for a new one.",
                             "INVALID_BLOCK_TOKEN")


def page_token(snapshot_id: str, next_block: int) -> str:
    return base64.b64encode(f"{snapshot_id}|{next_block}".encode()).decode("ascii")


def page_start(token: str, snapshot_id: str) -> int:
    """The block index a page token of ``snapshot_id``'s listing goes on from (``INVALID_PAGE_TOKEN``)."""
    raw = _decoded(token)
    match = _PAGE_RE.fullmatch(raw.decode("ascii", "replace")) if raw is not None else None
    if match is None or match.group(1) != snapshot_id:
        raise Validation("The page token is not valid for this request.", "INVALID_PAGE_TOKEN")
    return int(match.group(2))


def sha256_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")
