"""The contract of an instance-id resolver (one module per resolver, an entry point each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from vbs.config import ControllerConfig
from vbs.controller.db import Database
from vbs.errors import DriverError
from vbs.wire.connection import HOST_NAME_RE
from vbs.wire.host import VM_ID_RE

__all__ = ["InstanceResolver", "Location"]


@dataclass(frozen=True)
class Location:
    """Where an instance runs: a host agent's node name and the VM's id there."""

    host: str
    vm_id: str

    def __post_init__(self) -> None:
        if not HOST_NAME_RE.fullmatch(self.host) or not VM_ID_RE.fullmatch(self.vm_id):
            raise DriverError(f"a resolver answered an invalid location {self.host[:64]!r} {self.vm_id[:64]!r}")


@runtime_checkable
class InstanceResolver(Protocol):
    # The ids of its cloud, matched in full before anything else happens.
    id_pattern: str

    @classmethod
    def from_config(cls, scheme: str, argument: str | None, cfg: ControllerConfig) -> InstanceResolver:
        """The resolver of ``scheme`` (``argument``: what follows ``DRIVER:`` in the config)."""
        ...

    def locate(self, db: Database, cloud_id: str) -> Location | None:
        """Where the instance ``cloud_id`` (already matched against ``id_pattern``) runs; None when
        the cloud does not know it."""
        ...

