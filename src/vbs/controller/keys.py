"""Who a key is: the bootstrap keys (admins of tenant ``default``) and the keys ``vbs create-key`` makes.

A made key lives in the ``access_keys`` table with its tenant and role. SigV4 verifies with the
secret itself (a hash would not do), so the secret is sealed with AES-GCM under the controller's
master key (``<data_dir>/master.key``, mode 0600, made on first use) and bound to its key id; the
row alone opens nothing. Secrets are never logged and never written to operation rows.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from vbs import credentials
from vbs.controller.db import AccessKeyRecord, Database
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.errors import InvalidParameter, NotFound

__all__ = ["Role", "ROLES", "TENANT_RE", "Principal", "MasterKey", "KeyStore", "check_tenant"]

Role = Literal["admin", "user"]
ROLES: tuple[str, ...] = get_args(Role)
TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_NONCE = 12


def check_tenant(value: str) -> str:
    if not TENANT_RE.fullmatch(value):
        raise InvalidParameter(f"Invalid tenant {value[:64]!r}: 1-63 characters of [a-z0-9_-], starting with a letter "
                               "or digit.")
    return value


@dataclass(frozen=True)
class Principal:
    """The caller of one request: its key id, the tenant whose resources it sees, and its role."""

    access_key_id: str
    tenant: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


class MasterKey:
    """The AES-256-GCM key that seals made keys' secrets, kept in a private file made on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._aead: AESGCM | None = None

    def _key(self) -> AESGCM:
        if self._aead is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raw = base64.b64decode(self.path.read_text().strip())
            else:
                raw = AESGCM.generate_key(bit_length=256)
                with os.fdopen(fd, "w") as fh:
                    fh.write(base64.b64encode(raw).decode())
                    fh.flush()
                    os.fsync(fh.fileno())
            if len(raw) != 32:
                raise InvalidParameter(f"the master key {self.path} is not a base64 AES-256 key")
            self._aead = AESGCM(raw)
        return self._aead

    def seal(self, secret: str, key_id: str) -> str:
        nonce = os.urandom(_NONCE)
        return base64.b64encode(nonce + self._key().encrypt(nonce, secret.encode(), key_id.encode())).decode()

    def open(self, sealed: str, key_id: str) -> str | None:
        """The secret, or None where it does not open (another master key, or a row moved to another id)."""
        try:
            raw = base64.b64decode(sealed)
            return self._key().decrypt(raw[:_NONCE], raw[_NONCE:], key_id.encode()).decode()
        except (InvalidTag, ValueError):
            return None


@dataclass(frozen=True)
class KeyInfo:
    access_key_id: str
    tenant: str
    role: Role
    bootstrap: bool


class KeyStore:
    """Every key that may call the public APIs, and who each one is."""

    def __init__(self, db: Database, master: MasterKey, bootstrap: dict[str, str]) -> None:
        self.db = db
        self.master = master
        self.bootstrap = dict(bootstrap)

    def lookup(self, key_id: str) -> tuple[str, Principal] | None:
        """The secret of ``key_id`` and who it is, or None for a key that does not exist."""
        secret = self.bootstrap.get(key_id)
        if secret is not None:
            return secret, Principal(key_id, DEFAULT_TENANT, "admin")
        if not credentials.KEY_ID_RE.fullmatch(key_id):
            return None
        with self.db.read() as s:
            row = s.get(AccessKeyRecord, key_id)
            if row is None or row.role not in ROLES:
                return None
            opened = self.master.open(row.sealed_secret, key_id)
            role: Role = "admin" if row.role == "admin" else "user"
            return (opened, Principal(key_id, row.tenant, role)) if opened is not None else None

    def secret_of(self, key_id: str) -> str | None:
        found = self.lookup(key_id)
        return found[0] if found else None

    def create(self, tenant: str, role: str) -> credentials.AccessKey:
        check_tenant(tenant)
        if role not in ROLES:
            raise InvalidParameter(f"Invalid role {role[:16]!r}: admin or user.")
        for _ in range(5):
            key = credentials.generate()
            if key.access_key_id in self.bootstrap:
                continue
            try:
                with self.db.session() as s:
                    s.add(AccessKeyRecord(id=key.access_key_id, tenant=tenant, role=role, created_at=utcnow(),
                                          sealed_secret=self.master.seal(key.secret_access_key, key.access_key_id)))
                return key
            except IntegrityError:
                continue
        raise InvalidParameter("could not make a unique access key id; try again")

    def delete(self, key_id: str) -> None:
        if key_id in self.bootstrap:
            raise InvalidParameter("A bootstrap key (configuration, environment or credentials file) cannot be "
                                   "deleted through the API; remove it where it is configured.")
        with self.db.session() as s:
            row = s.get(AccessKeyRecord, key_id) if credentials.KEY_ID_RE.fullmatch(key_id) else None
            if row is None:
                raise NotFound(f"The access key '{key_id[:64]}' does not exist.", code="InvalidAccessKeyId.NotFound")
            s.delete(row)

    def list(self) -> list[KeyInfo]:
        out = [KeyInfo(k, DEFAULT_TENANT, "admin", True) for k in sorted(self.bootstrap)]
        with self.db.read() as s:
            for row in s.scalars(select(AccessKeyRecord).order_by(AccessKeyRecord.id)):
                out.append(KeyInfo(row.id, row.tenant, "admin" if row.role == "admin" else "user", False))
        return out
