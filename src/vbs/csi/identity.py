"""The CSI Identity service: the driver's name and version, what it offers, and whether it is ready."""

from __future__ import annotations

from typing import Any

from vbs import __version__
from vbs.csi import proto
from vbs.csi.rpc import rpc

__all__ = ["IdentityService", "DRIVER_NAME"]

DRIVER_NAME = "csi.vbs.io"


class IdentityService:
    def __init__(self, *, controller: bool, ready: Any) -> None:
        """``controller``: this process serves the Controller service too; ``ready()``: can it serve now."""
        self.pb = proto.pb()
        self.controller = controller
        self.ready = ready

    @rpc
    def GetPluginInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 - the spec's names
        return self.pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802
        cap = self.pb.PluginCapability
        caps = [cap(service=cap.Service(type=cap.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS))]
        if self.controller:
            caps.append(cap(service=cap.Service(type=cap.Service.CONTROLLER_SERVICE)))
            caps.append(cap(volume_expansion=cap.VolumeExpansion(type=cap.VolumeExpansion.ONLINE)))
        return self.pb.GetPluginCapabilitiesResponse(capabilities=caps)

    @rpc
    def Probe(self, request: Any, context: Any) -> Any:  # noqa: N802
        response = self.pb.ProbeResponse()
        response.ready.value = bool(self.ready())
        return response
