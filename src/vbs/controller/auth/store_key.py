"""The snapshot store's key: one secret of the install, kept by the controller and handed to agents per call.

Chunk ids in the store are keyed per tenant (docs/snapshots.md, "Tenants and keys"), every tenant's key
made from one store key. Every storage agent that uploads to or restores from the store must hold the
same key, so the controller keeps it, as it keeps volumes' data keys: 32 random bytes made on first use,
sealed under the master key in the ``volume_keys`` table (row ``STORE_KEY_ID``), rotated with it by
``vbs rotate-keys --master-key``. It reaches an agent only inside the one request that uploads or
restores (``StoreSnapshot.store_key``): never in an operation row, a log line, an argv or a file on the
agent.
"""

from __future__ import annotations

import secrets

from pydantic import SecretStr
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vbs.controller.auth.encryption import KeyUnavailable
from vbs.controller.auth.keys import MasterKey
from vbs.controller.db import Database, VolumeKey
from vbs.controller.db.tables import utcnow

__all__ = ["STORE_KEY_ID", "store_key"]

STORE_KEY_ID = "snapshot-store"
# What the row says in the place of a volume key's KMS key id (nobody asks for it by that).
_KIND = "vbs:snapshot-store"
_KEY_BYTES = 32


def _read(s: Session, master: MasterKey) -> SecretStr | None:
    row = s.get(VolumeKey, STORE_KEY_ID)
    if row is None:
        return None
    opened = master.open(row.sealed_key, STORE_KEY_ID)
    if opened is None:
        raise KeyUnavailable("the snapshot store key opens with none of the master keys")
    return SecretStr(opened)


def store_key(db: Database, master: MasterKey) -> SecretStr:
    """The store key (hex), made and sealed the first time (two controllers making it at once: the first
    insert wins and both answer its key)."""
    with db.read() as s:
        found = _read(s, master)
    if found is not None:
        return found
    try:
        with db.session() as s:
            s.add(VolumeKey(id=STORE_KEY_ID, sealed_key=master.seal(secrets.token_bytes(_KEY_BYTES).hex(),
                                                                    STORE_KEY_ID),
                            kms_key_id=_KIND, created_at=utcnow()))
    except IntegrityError:
        pass  # another controller (or request) made it meanwhile: its key is the one
    with db.read() as s:
        made = _read(s, master)
    if made is None:
        raise KeyUnavailable("the snapshot store key could not be made")
    return made
