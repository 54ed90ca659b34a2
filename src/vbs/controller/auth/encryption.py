"""Encrypted volumes: their data keys, kept by the controller and sealed with its master key.

A volume created encrypted gets a random 256-bit data key; its storage node formats it as a LUKS
container with that key as the passphrase, and the data path opens it with QEMU's ``luks`` driver — on
the hypervisor host (then neither the network nor the storage node sees plaintext). Its snapshots and
the volumes made from them are copies of the container, so they share the key row. The key reaches an
agent only inside the one request that needs it (never in an operation row, a log or an argv); the
master key is rotated with ``vbs rotate-keys --master-key`` (docs/security.md).

VBS has one key-encryption key, the master key: ``KmsKeyId`` is recorded and reported as given (EC2's
default ``alias/aws/ebs`` where none is), so code written for AWS sees what it asked for.
"""

from __future__ import annotations

import base64
import re
import secrets
from typing import NamedTuple

from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth.keys import MasterKey
from vbs.controller.db import VolumeKey
from vbs.controller.db.tables import utcnow
from vbs.errors import InvalidParameter, VbsError

DEFAULT_KMS_KEY_ID = "alias/aws/ebs"
KMS_KEY_RE = re.compile(r"[A-Za-z0-9:/_.+=@-]{1,2048}")
DATA_KEY_BYTES = 32


class KeyUnavailable(VbsError):
    code = "KeyUnavailable"
    status = 500


def check_kms_key_id(value: str | None) -> str:
    """The KMS key id to record: ``value`` (an alias, key id or ARN) or EC2's default."""
    if value is None:
        return DEFAULT_KMS_KEY_ID
    if not KMS_KEY_RE.fullmatch(value):
        raise InvalidParameter(f"Invalid KmsKeyId {value[:64]!r}: an alias (alias/NAME), a key id or an ARN.",
                               code="InvalidParameterValue")
    return value


def new_key(s: Session, master: MasterKey, kms_key_id: str) -> str:
    """A new data key, sealed; its id."""
    key_id = ids.new_id("volume-key")
    passphrase = base64.b64encode(secrets.token_bytes(DATA_KEY_BYTES)).decode()
    s.add(VolumeKey(id=key_id, sealed_key=master.seal(passphrase, key_id), kms_key_id=kms_key_id,
                    created_at=utcnow()))
    return key_id


class CopyKey(NamedTuple):
    """The data key of a copy (None: plain), whether the copy's data is written encrypted under it as it is
    copied (``rewrite``: re-encrypted, or encrypted for the first time), and the key the source's data opens
    with for that (None: the source's data is plain)."""

    key_id: str | None
    rewrite: bool
    source_key_id: str | None


def key_for_copy(s: Session, master: MasterKey, source_key_id: str | None, *, encrypted: bool,
                 kms_key_id: str | None, source_plain: bool = False) -> CopyKey:
    """The data key of a copy of something encrypted under ``source_key_id`` (or plain, or nothing: a new
    volume) as asked.

    A copy of an encrypted source is encrypted (``Encrypted`` may be left out, as on EBS) under the source's
    key, unless another KMS key id is asked for; then, and for a plain source asked to be encrypted, a new
    key, the data re-encrypted under it. ``source_plain``: the source is encrypted under its key though its
    data is plaintext (a snapshot written through the EBS direct APIs, docs/ebs-direct.md): the copy is
    encrypted as it is written, under the source's key or the one asked for."""
    if kms_key_id is not None and not encrypted and source_key_id is None:
        raise InvalidParameter("The parameter KmsKeyId requires the parameter Encrypted to be set.",
                               code="InvalidParameterDependency")
    if source_key_id is None:
        key_id = new_key(s, master, check_kms_key_id(kms_key_id)) if encrypted else None
        return CopyKey(key_id, key_id is not None, None)
    kms = kms_key_ids(s, {source_key_id}).get(source_key_id)
    if kms_key_id is None or kms_key_id == kms:
        return CopyKey(source_key_id, source_plain, None)
    return CopyKey(new_key(s, master, check_kms_key_id(kms_key_id)), True, None if source_plain else source_key_id)


def passphrase(s: Session, master: MasterKey, key_id: str) -> SecretStr:
    """The passphrase of ``key_id``'s LUKS containers."""
    row = s.get(VolumeKey, key_id)
    opened = master.open(row.sealed_key, key_id) if row is not None else None
    if opened is None:
        raise KeyUnavailable(f"the data key {key_id} is missing or opens with none of the master keys")
    return SecretStr(opened)


def kms_key_ids(s: Session, key_ids: set[str]) -> dict[str, str]:
    """The recorded KMS key id of each data key."""
    if not key_ids:
        return {}
    return {k: kms for k, kms in s.execute(select(VolumeKey.id, VolumeKey.kms_key_id)
                                              .where(VolumeKey.id.in_(sorted(key_ids))))}
