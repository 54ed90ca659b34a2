"""QEMU's nodes of an encrypted volume: the passphrase as a ``secret`` object and the ``luks`` format node
over the protocol node, for every QEMU process that opens one (a guest's, a host's local-path daemon)."""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

__all__ = ["LUKS_OPEN_TIMEOUT_S", "qemu_secret", "qemu_luks_node"]

# How long a ``blockdev-add`` of a luks node may take: QEMU derives the container's key first (PBKDF2,
# calibrated by ``qemu-img create`` to take 2 s on the machine that formatted it), with its monitor
# blocked meanwhile. On a loaded 2-core host beside TCG guests that took over 10 s, the QMP default.
LUKS_OPEN_TIMEOUT_S = 120.0


def qemu_secret(secret_id: str, luks: SecretStr) -> dict[str, Any]:
    """The QMP ``object-add`` of the passphrase (over the monitor socket: never an argv or a file)."""
    return {"qom-type": "secret", "id": secret_id, "data": luks.get_secret_value(), "format": "raw"}


def qemu_luks_node(node: str, file: str, secret_id: str, read_only: bool) -> dict[str, Any]:
    """The ``luks`` format node over the protocol node ``file``: its users see the plaintext."""
    return {"driver": "luks", "node-name": node, "file": file, "key-secret": secret_id, "read-only": read_only,
            "discard": "unmap"}
