"""Encrypted volumes at the hypervisor: what a driver without LUKS support answers, and QEMU's nodes."""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

from vbs.errors import IncorrectState


def refuse_luks(luks: SecretStr | None, driver: str) -> None:
    """Fail closed: a driver that cannot open a LUKS container never attaches it (the guest would see
    ciphertext, or a mistaken format would write plaintext)."""
    if luks is not None:
        raise IncorrectState(f"{driver} cannot open encrypted volumes; attach them on a host with the qemu driver")


def qemu_secret(secret_id: str, luks: SecretStr) -> dict[str, Any]:
    """The QMP ``object-add`` of the passphrase (over the monitor socket: never an argv or a file)."""
    return {"qom-type": "secret", "id": secret_id, "data": luks.get_secret_value(), "format": "raw"}


def qemu_luks_node(node: str, file: str, secret_id: str, read_only: bool) -> dict[str, Any]:
    """The ``luks`` format node over the protocol node ``file``: guests see its plaintext."""
    return {"driver": "luks", "node-name": node, "file": file, "key-secret": secret_id, "read-only": read_only,
            "discard": "unmap"}
