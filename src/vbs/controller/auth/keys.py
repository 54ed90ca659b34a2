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
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast, get_args

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from vbs.controller.db import AccessKeyRecord, Database, VolumeKey
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.errors import InvalidParameter, NotFound
from vbs.system.files import write_private
from vbs.trust import credentials

__all__ = ["Role", "ROLES", "TENANT_RE", "Principal", "MasterKey", "KeyStore", "check_tenant", "as_role"]

# ``metrics``: reads ``/metrics`` and nothing else (a monitoring system's key).
Role = Literal["admin", "user", "metrics"]
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

    @property
    def reads_metrics_only(self) -> bool:
        return self.role == "metrics"


def as_role(value: str) -> Role:
    """A stored role as a ``Role`` (a row's role was checked against ``ROLES`` when it was made)."""
    return cast(Role, value) if value in ROLES else "user"


class MasterKey:
    """The AES-256-GCM keys that seal made keys' secrets, in a private file made on first use.

    The file holds one base64 key per line, the current one first: secrets are sealed with it and
    opened with whichever line opens them. ``vbs rotate-keys --master-key`` adds a new first line,
    re-seals every secret under it, then drops the old lines; a running controller re-reads the file
    when it changes, so it opens every secret at each stage (no downtime).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys: list[AESGCM] = []
        self._seen: tuple[int, int, int] | None = None
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Make the file now if it does not exist (every controller of an install needs the same one:
        ``vbs bootstrap-key`` makes it before the first start, so that it can be copied to the others)."""
        self._load()

    def _load(self) -> list[AESGCM]:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as fh:
                    fh.write(_new_key_line())
                    fh.flush()
                    os.fsync(fh.fileno())
            st = self.path.stat()
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen != self._seen:
                self._keys = [AESGCM(raw) for raw in _read_keys(self.path)]
                self._seen = seen
            return self._keys

    def seal(self, secret: str, key_id: str) -> str:
        return _seal(self._load()[0], secret, key_id)

    def open(self, sealed: str, key_id: str) -> str | None:
        """The secret, or None where it does not open (another master key, or a row moved to another id)."""
        for key in self._load():
            secret = _open(key, sealed, key_id)
            if secret is not None:
                return secret
        return None

    def rotate(self, db: Database) -> int:
        """Seal every made access key's secret and every volume data key under a new master key; the number
        of secrets re-sealed.

        The old keys stay in the file until every row opens with the new one (a key made by a
        running controller meanwhile included), so an interrupted rotation loses nothing: run it again.
        """
        new_raw = AESGCM.generate_key(bit_length=256)
        new = AESGCM(new_raw)
        old = _read_keys(self.path) if self.path.exists() else []
        write_private(self.path, "".join(_line(raw) for raw in [new_raw, *old]))
        resealed: set[str] = set()
        for _ in range(3):
            stale = 0
            with db.session() as s:
                rows: list[AccessKeyRecord | VolumeKey] = [*s.scalars(select(AccessKeyRecord).with_for_update()),
                                                           *s.scalars(select(VolumeKey).with_for_update())]
                for row in rows:
                    field = "sealed_secret" if isinstance(row, AccessKeyRecord) else "sealed_key"
                    sealed = getattr(row, field)
                    if _open(new, sealed, row.id) is not None:
                        continue
                    secret = self.open(sealed, row.id)
                    if secret is None:
                        raise InvalidParameter(f"the secret of {row.id} opens with none of the master keys in "
                                               f"{self.path}; the old keys are kept")
                    setattr(row, field, _seal(new, secret, row.id))
                    resealed.add(row.id)
                    stale += 1
            if stale == 0:
                write_private(self.path, _line(new_raw))
                return len(resealed)
        raise InvalidParameter("keys kept being made under the old master key; run the rotation again")


def _seal(key: AESGCM, secret: str, key_id: str) -> str:
    nonce = os.urandom(_NONCE)
    return base64.b64encode(nonce + key.encrypt(nonce, secret.encode(), key_id.encode())).decode()


def _open(key: AESGCM, sealed: str, key_id: str) -> str | None:
    try:
        raw = base64.b64decode(sealed)
        return key.decrypt(raw[:_NONCE], raw[_NONCE:], key_id.encode()).decode()
    except (InvalidTag, ValueError):
        return None


def _line(raw: bytes) -> str:
    return base64.b64encode(raw).decode() + "\n"


def _new_key_line() -> str:
    return _line(AESGCM.generate_key(bit_length=256))


def _read_keys(path: Path) -> list[bytes]:
    keys = [base64.b64decode(line) for line in path.read_text().split() if line]
    if not keys or any(len(k) != 32 for k in keys):
        raise InvalidParameter(f"the master key file {path} does not hold base64 AES-256 keys")
    return keys


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
            return (opened, Principal(key_id, row.tenant, as_role(row.role))) if opened is not None else None

    def secret_of(self, key_id: str) -> str | None:
        found = self.lookup(key_id)
        return found[0] if found else None

    def create(self, tenant: str, role: str) -> credentials.AccessKey:
        check_tenant(tenant)
        if role not in ROLES:
            raise InvalidParameter(f"Invalid role {role[:16]!r}: admin, user or metrics.")
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

    def successor(self, key_id: str) -> tuple[credentials.AccessKey, KeyInfo]:
        """A new key with the tenant and role of ``key_id`` (which keeps working until deleted)."""
        found = self.lookup(key_id) if credentials.KEY_ID_RE.fullmatch(key_id) or key_id in self.bootstrap else None
        if found is None:
            raise NotFound(f"The access key '{key_id[:64]}' does not exist.", code="InvalidAccessKeyId.NotFound")
        who = found[1]
        return self.create(who.tenant, who.role), KeyInfo(key_id, who.tenant, who.role, key_id in self.bootstrap)

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
                out.append(KeyInfo(row.id, row.tenant, as_role(row.role), False))
        return out
