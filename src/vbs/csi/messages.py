"""VBS's volumes and snapshots as CSI messages, and CSI's capabilities as ``requests.Capability``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from vbs.csi.requests import GIB, TOPOLOGY_KEY, Capability
from vbs.csi.vbs_api import Body

__all__ = ["capabilities", "volume_message", "snapshot_message", "published_hosts", "LIVE_ATTACHMENT"]

LIVE_ATTACHMENT = frozenset({"attaching", "attached", "busy"})


def capabilities(pb: Any, caps: Any) -> list[Capability]:
    """Repeated VolumeCapability messages as plain values."""
    out = []
    for cap in caps:
        kind = cap.WhichOneof("access_type") or ""
        fs_type = cap.mount.fs_type if kind == "mount" else ""
        out.append(Capability(kind, fs_type, pb.VolumeCapability.AccessMode.Mode.Name(cap.access_mode.mode)))
    return out


def published_hosts(volume: Body) -> list[str]:
    """The hosts (CSI node ids) a volume is attached to, or being attached to."""
    return sorted({a["host"] for a in volume["attachments"] if a["state"] in LIVE_ATTACHMENT})


def volume_message(pb: Any, volume: Body, *, source: Any = None, context: dict[str, str] | None = None) -> Any:
    msg = pb.Volume(volume_id=volume["volume_id"], capacity_bytes=int(volume["size_gib"]) * GIB,
                    volume_context=context or {},
                    accessible_topology=[pb.Topology(segments={TOPOLOGY_KEY: volume["availability_zone"]})])
    if source is not None:
        msg.content_source.CopyFrom(source)
    return msg


def snapshot_message(pb: Any, snapshot: Body) -> Any:
    msg = pb.Snapshot(snapshot_id=snapshot["snapshot_id"], source_volume_id=snapshot["volume_id"],
                      size_bytes=int(snapshot["volume_size_gib"]) * GIB,
                      ready_to_use=snapshot["status"] == "completed")
    msg.creation_time.FromDatetime(datetime.fromisoformat(snapshot["started_at"].replace("Z", "+00:00")))
    return msg
