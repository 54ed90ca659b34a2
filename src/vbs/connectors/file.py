"""A volume file on this machine, opened by the hypervisor directly (tests, local placement)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from vbs.connectors.base import HostConnector, QemuBlockdev, QemuIds
from vbs.wire.connection import FileConnection

__all__ = ["FileConnector"]


class FileConnector(HostConnector[FileConnection]):
    protocol: ClassVar[str] = "file"
    # The file grows under its node, and a second node on it would not get the write lock.
    qemu_node_sees_growth: ClassVar[bool] = True

    def qemu_blockdev(self, connection: FileConnection, ids: QemuIds) -> QemuBlockdev:
        return QemuBlockdev(options={"driver": "file", "filename": connection.path})

    def qemu_node_opens(self, node: Mapping[str, Any], connection: FileConnection) -> bool:
        return node.get("drv") == "file" and node.get("file") == connection.path
