"""Encrypted volumes at the hypervisor: what a driver without LUKS support answers (QEMU's nodes for
them: ``vbs.qemu.luks_nodes``)."""

from __future__ import annotations

from pydantic import SecretStr

from vbs.errors import IncorrectState


def refuse_luks(luks: SecretStr | None, driver: str) -> None:
    """Fail closed: a driver that cannot open a LUKS container never attaches it (the guest would see
    ciphertext, or a mistaken format would write plaintext)."""
    if luks is not None:
        raise IncorrectState(f"{driver} cannot open encrypted volumes; attach them on a host with the qemu driver")
