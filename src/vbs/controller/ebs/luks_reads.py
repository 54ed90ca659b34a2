"""An encrypted volume's snapshot read block by block as plaintext (docs/ebs-direct.md "Encrypted
snapshots"): the snapshot is the volume's LUKS container, so the controller, which holds the data key,
reads the container's blocks from a storage agent as they are stored (ciphertext) and decrypts them itself
(``vbs.qemu.luks1``): the storage node and the network still see only ciphertext.

The payload starts ``payload_offset`` bytes into the container (QEMU: 4,040 sectors, not a whole number of
blocks), so a block of the volume spans two blocks of the container: it holds data when either is stored,
and it changed when either's chunk did. Opening the volume key costs the key slot's PBKDF2 (about 2 s); the
last few opened stay in the controller's memory (``KEYS_KEPT``), as the headers do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from pydantic import SecretStr

from vbs.controller.auth import encryption
from vbs.controller.db import Snapshot
from vbs.controller.runtime import Controller
from vbs.controller.workflows import stored
from vbs.qemu import luks1
from vbs.snapshot_store.format import BLOCK_SIZE

__all__ = ["is_container", "payload_blocks", "read_block", "KEYS_KEPT"]

KEYS_KEPT = 8
HEADERS_KEPT = 64
K = TypeVar("K")
V = TypeVar("V")


class _Kept(OrderedDict[K, V]):
    """The last ``size`` values made, by key. Made outside the lock: two threads asking for one value at
    once may both make it, and no read waits for another snapshot's key."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.lock = threading.Lock()

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        with self.lock:
            if key in self:
                self.move_to_end(key)
                return self[key]
        value = make()
        with self.lock:
            self[key] = value
            while len(self) > self.size:
                self.popitem(last=False)
        return value


_headers: _Kept[str, tuple[luks1.Header, bytes]] = _Kept(HEADERS_KEPT)
_keys: _Kept[tuple[str, bytes], bytes] = _Kept(KEYS_KEPT)


def is_container(snap: Snapshot) -> bool:
    """Whether the snapshot's data is its volume's LUKS container (an encrypted volume's snapshot)."""
    return snap.key_id is not None and not snap.plain_data


def _head(svc: Controller, snap: Snapshot, store_key: SecretStr) -> tuple[luks1.Header, bytes]:
    """The container's header and its bytes up to the end of the key material (which never change)."""
    def read() -> tuple[luks1.Header, bytes]:
        agent = stored.store_agent(svc, snap)
        head = agent.read_block(snap.id, 0, snap.tenant, store_key)
        header = luks1.parse_header(head)
        while len(head) < header.material_end():
            head += agent.read_block(snap.id, len(head) // BLOCK_SIZE, snap.tenant, store_key)
        return header, head
    return _headers.get_or_make(snap.id, read)


def _span(header: luks1.Header, index: int) -> tuple[int, int]:
    """The container's blocks that the volume's block ``index`` lies in."""
    start = header.payload_offset + index * BLOCK_SIZE
    return start // BLOCK_SIZE, (start + BLOCK_SIZE - 1) // BLOCK_SIZE


def payload_blocks(svc: Controller, snap: Snapshot, container: dict[int, str], store_key: SecretStr) -> dict[int, str]:
    """The volume's blocks that hold data, each with what it is made of (the chunks of its two container
    blocks: equal for equal content under one key), from the container's stored blocks."""
    header, _ = _head(svc, snap, store_key)
    count = snap.volume_size_gib * (1 << 30) // BLOCK_SIZE
    touched: set[int] = set()
    for c in container:
        for edge in (c * BLOCK_SIZE, (c + 1) * BLOCK_SIZE - 1):
            index = (edge - header.payload_offset) // BLOCK_SIZE
            if 0 <= index < count:
                touched.add(index)
    out = {}
    for index in sorted(touched):
        first, second = _span(header, index)
        out[index] = f"{container.get(first, '0')}+{container.get(second, '0')}"
    return out


def read_block(svc: Controller, snap: Snapshot, index: int, store_key: SecretStr) -> bytes:
    """The volume's block ``index`` as plaintext."""
    assert snap.key_id is not None
    header, head = _head(svc, snap, store_key)
    key_id = snap.key_id

    def open_key() -> bytes:
        with svc.db.read() as s:
            passphrase = encryption.passphrase(s, svc.master_key, key_id)
        return luks1.open_volume_key(header, head, passphrase.get_secret_value().encode())
    volume_key = _keys.get_or_make((key_id, header.digest), open_key)
    agent = stored.store_agent(svc, snap)
    first, second = _span(header, index)
    data = b"".join(agent.read_block(snap.id, c, snap.tenant, store_key) for c in range(first, second + 1))
    skip = header.payload_offset + index * BLOCK_SIZE - first * BLOCK_SIZE
    return luks1.decrypt(volume_key, data[skip:skip + BLOCK_SIZE], index * BLOCK_SIZE)
