"""StartSnapshot's encryption (docs/ebs-direct.md "Encrypted snapshots"): which of ``Encrypted``,
``KmsKeyArn`` and ``ParentSnapshotId`` go together, as AWS's encryption outcomes have it (encryption by
default is off), and the data key a new snapshot is encrypted under.

VBS has no KMS: a KMS key is the id recorded with a data key, as EC2 CreateVolume and CopySnapshot record
theirs (``vbs.controller.auth.encryption``, whose ``key_for_copy`` chooses the key here too). A
``KmsKeyArn`` must be an ARN of a key of the caller's own account in this region: any other names no key
the caller may use (``AccessDeniedException``, ``DEPENDENCY_ACCESS_DENIED``, as KMS refusing the key).

The blocks of an encrypted snapshot are kept as the snapshot store keeps every chunk (encrypted under the
tenant's store key), its row marked ``plain_data``; a volume made from it is encrypted under the
snapshot's key as it is restored.
"""

from __future__ import annotations

import re

from sqlalchemy.orm import Session

from vbs.controller.auth import encryption
from vbs.controller.db import Snapshot
from vbs.controller.ebs.errors import AccessDenied, Validation
from vbs.controller.ebs.luks_reads import is_container
from vbs.controller.requests.snapshot_permissions import owner_id
from vbs.controller.runtime import Controller

__all__ = ["check_combination", "usable_kms_key", "snapshot_key", "kms_key_arn", "KMS_KEY_ARN_RE"]

# AWS's pattern (arn:aws…:kms:…:ACCOUNT:key/…) with VBS's accounts: 000000000000 or a tenant's name.
KMS_KEY_ARN_RE = re.compile(r"arn:aws[a-z-]{0,16}:kms:([a-z0-9-]{1,32}):([a-z0-9][a-z0-9_-]{0,62}):key/"
                            r"[A-Za-z0-9_-]{1,128}")


def check_combination(encrypted: bool | None, kms_key_arn: str | None, parent_snapshot_id: str | None) -> None:
    """Refuse what AWS refuses before it looks at anything: ``Encrypted`` or ``KmsKeyArn`` with a parent (a
    child is encrypted as its parent is), ``KmsKeyArn`` without ``Encrypted`` true, a malformed ARN."""
    if parent_snapshot_id is not None and encrypted is not None:
        raise Validation("You can't specify ParentSnapshotId and Encrypted in the same request: a snapshot with "
                         "a parent is encrypted as its parent is.")
    if parent_snapshot_id is not None and kms_key_arn is not None:
        raise Validation("You can't specify ParentSnapshotId and KmsKeyArn in the same request: a snapshot with "
                         "an encrypted parent is encrypted under the parent's KMS key.")
    if kms_key_arn is not None and encrypted is not True:
        raise Validation("The parameter KmsKeyArn requires the parameter Encrypted to be true.")
    if kms_key_arn is not None and not KMS_KEY_ARN_RE.fullmatch(kms_key_arn):
        raise Validation(f"Invalid KmsKeyArn {kms_key_arn[:64]!r}: the ARN of a KMS key "
                         "(arn:aws:kms:REGION:ACCOUNT:key/KEY-ID).")


def usable_kms_key(kms_key_arn: str, tenant: str, region: str) -> str:
    """``kms_key_arn`` (well formed) if it names a key of the tenant's account in ``region``."""
    found = KMS_KEY_ARN_RE.fullmatch(kms_key_arn)
    assert found is not None, "check_combination first"
    if found.group(2) != owner_id(tenant) or found.group(1) != region:
        raise AccessDenied(f"The KMS key {kms_key_arn[:128]} is not one this account may use in {region}: the "
                           "snapshot cannot be encrypted under it.", "DEPENDENCY_ACCESS_DENIED")
    return kms_key_arn


def snapshot_key(s: Session, svc: Controller, tenant: str, *, encrypted: bool | None, kms_key_arn: str | None,
                 parent: Snapshot | None) -> str | None:
    """The data key of a new snapshot (None: plain): a child shares its parent's key, as a volume's snapshots
    share the volume's; ``Encrypted`` true makes a new one under ``KmsKeyArn`` (or the default)."""
    if parent is None:
        kms = usable_kms_key(kms_key_arn, tenant, svc.cfg.region) if kms_key_arn is not None else None
        return encryption.key_for_copy(s, svc.master_key, None, encrypted=bool(encrypted), kms_key_id=kms).key_id
    if is_container(parent):
        raise Validation(f"The parent snapshot '{parent.id}' is an encrypted volume's snapshot, kept as its LUKS "
                         "container: blocks cannot be put over it here. Start the snapshot without a parent.",
                         "INVALID_SNAPSHOT_ID")
    return encryption.key_for_copy(s, svc.master_key, parent.key_id, encrypted=False, kms_key_id=None,
                                   source_plain=True).key_id


def kms_key_arn(s: Session, svc: Controller, tenant: str, key_id: str) -> str:
    """The ``KmsKeyArn`` StartSnapshot answers for a snapshot encrypted under ``key_id``: the ARN it was
    asked for, or the ARN of the default key's alias (``alias/aws/ebs``, as DescribeSnapshots shows it)."""
    kms = encryption.kms_key_ids(s, {key_id}).get(key_id, encryption.DEFAULT_KMS_KEY_ID)
    if kms.startswith("arn:"):
        return kms
    return f"arn:aws:kms:{svc.cfg.region}:{owner_id(tenant)}:{kms if kms.startswith('alias/') else 'key/' + kms}"
