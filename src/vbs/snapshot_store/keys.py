"""The store key, the tenants' keys made from it, and the store's identity object.

Chunk ids are keyed per tenant (``format.chunk_id``): the same bytes have different ids for two
tenants, so one tenant cannot learn whether another holds some data by watching what deduplication
skips, and whoever can list the bucket cannot test it for a known file without the key.

One secret, the store key (32 random bytes: the controller keeps it sealed and hands it to the storage
agent with each upload and restore, ``vbs.controller.auth.store_key``; a tool may keep one in a 0600
file, ``snapshot-store.key``), makes every tenant's key: ``HMAC-SHA256(store key,
"vbs-snapshot-store tenant key v1" NUL tenant)``. Every agent that writes to or restores from one
store holds the same store key. The store remembers a check value of it (``store.json`` at its root,
written by the first agent), so an agent with another key is refused instead of writing chunks that
nobody else could verify or deduplicate against.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path

from vbs.errors import DriverError, SnapshotDataError
from vbs.snapshot_store.contract import ObjectMissing, SnapshotStore
from vbs.snapshot_store.format import FORMAT_VERSION, check_tenant, json_object
from vbs.system.files import write_private

__all__ = ["StoreKey", "KEY_FILE_NAME", "STORE_IDENTITY", "open_store"]

KEY_FILE_NAME = "snapshot-store.key"
STORE_IDENTITY = "store.json"
_KEY_BYTES = 32


class StoreKey:
    """The secret every tenant key of one store is made from."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != _KEY_BYTES:
            raise DriverError(f"a snapshot store key is {_KEY_BYTES} bytes, not {len(secret)}")
        self._secret = secret

    def __repr__(self) -> str:
        return f"StoreKey(check={self.check_value()})"

    @classmethod
    def generate(cls) -> StoreKey:
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def load(cls, path: Path) -> StoreKey:
        """The key in ``path`` (hex), which only its owner may read."""
        try:
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise DriverError(f"the snapshot store key {path} may be read by others (mode {mode & 0o777:o}); "
                                  "make it 0600")
            return cls(bytes.fromhex(path.read_text().strip()))
        except OSError as exc:
            raise DriverError(f"cannot read the snapshot store key {path}: {exc.strerror}") from None
        except ValueError:
            raise DriverError(f"the snapshot store key {path} is not {_KEY_BYTES} bytes in hex") from None

    @classmethod
    def load_or_create(cls, path: Path) -> StoreKey:
        """The key in ``path``, made (0600) the first time."""
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            made = cls.generate()
            tmp = path.with_name(f".{path.name}.new")
            write_private(tmp, made._secret.hex() + "\n")
            try:
                os.link(tmp, path)  # never replaces a key another process made meanwhile
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        return cls.load(path)

    def tenant_key(self, tenant: str) -> bytes:
        info = b"vbs-snapshot-store tenant key v1\0" + check_tenant(tenant).encode()
        return hmac.digest(self._secret, info, "sha256")

    def check_value(self) -> str:
        """Names the key without revealing it (kept in the store's identity object)."""
        return hmac.digest(self._secret, b"vbs-snapshot-store key check", "sha256").hex()[:16]


def open_store(store: SnapshotStore, key: StoreKey) -> None:
    """Make sure ``store`` is a VBS snapshot store of this format and this key (making its identity
    object on first use); a ``DriverError`` says what does not match."""
    try:
        blob = store.get(STORE_IDENTITY)
    except ObjectMissing:
        doc = {"format": "vbs-snapshot-store", "format_version": FORMAT_VERSION,
               "key_check": key.check_value(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        store.put(STORE_IDENTITY, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
        blob = store.get(STORE_IDENTITY)  # another agent may have made it first: its key wins
    try:
        found = json_object(blob)
    except ValueError:
        raise SnapshotDataError(f"the snapshot store {store.describe()} has a damaged {STORE_IDENTITY}") from None
    if found.get("format") != "vbs-snapshot-store" or found.get("format_version") != FORMAT_VERSION:
        raise DriverError(f"{store.describe()} is not a VBS snapshot store of format version {FORMAT_VERSION} "
                          f"(it says {found.get('format')!r} version {found.get('format_version')!r})")
    if found.get("key_check") != key.check_value():
        raise DriverError(f"the snapshot store {store.describe()} was made with another store key "
                          f"(its check value is {found.get('key_check')!r}, this agent's {key.check_value()!r}): "
                          "every agent of one store needs the same key")

