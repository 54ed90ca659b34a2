"""The CSI spec's generated modules (``vbs.csi._generated``), made at set-up by scripts/csi-toolchain from
the spec's ``csi.proto`` (docs/kubernetes.md "Building") and never committed: imported here, on first use,
with a clear error when they were not made."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vbs.errors import VbsError

__all__ = ["pb", "pb_grpc", "CsiSetupMissing"]


class CsiSetupMissing(VbsError):
    code = "CsiSetupMissing"
    status = 500


def _load(name: str) -> ModuleType:
    import importlib

    try:
        return importlib.import_module(f"vbs.csi._generated.{name}")
    except ImportError as exc:
        raise CsiSetupMissing(
            f"the CSI spec's generated modules are missing ({exc}): run `make setup` (scripts/csi-toolchain "
            "compiles csi.proto with grpcio-tools; docs/kubernetes.md \"Building\")") from exc


def pb() -> Any:
    """``csi_pb2``: the messages."""
    return _load("csi_pb2")


def pb_grpc() -> Any:
    """``csi_pb2_grpc``: the service stubs and servicer bases."""
    return _load("csi_pb2_grpc")
