"""The CSI gRPC server on a unix socket (docs/kubernetes.md "Running vbs csi"): the Identity service always,
the Controller service with a controller's URL and key, the Node service with a node id; stopped by SIGTERM
or SIGINT after the calls under way end."""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vbs.csi import proto
from vbs.csi.controller import ControllerService
from vbs.csi.identity import IdentityService
from vbs.csi.node import NodeService
from vbs.csi.node_devices import NodeDevices
from vbs.csi.vbs_api import VbsApi
from vbs.errors import InvalidParameter

__all__ = ["CsiConfig", "serve", "socket_of"]

log = logging.getLogger("vbs.csi")

GRACE_S = 30.0


@dataclass(frozen=True)
class CsiConfig:
    socket: Path
    api: VbsApi | None  # the Controller service's (None: node only)
    node_id: str | None  # the Node service's (None: controller only)
    zone: str | None
    disk_dir: Path
    node_vm: str
    workers: int = 8


def socket_of(endpoint: str) -> Path:
    """The path of ``unix:///path`` (CSI's endpoint form; the only one served)."""
    if not endpoint.startswith("unix://"):
        raise InvalidParameter(f"--endpoint must be unix:///PATH, not {endpoint[:60]!r}")
    path = Path(endpoint.removeprefix("unix://"))
    if not path.is_absolute():
        raise InvalidParameter("--endpoint must name an absolute path: unix:///PATH")
    return path


def build(cfg: CsiConfig) -> Any:
    """The gRPC server with its services added, not started."""
    import grpc

    if cfg.api is None and cfg.node_id is None:
        raise InvalidParameter("vbs csi serves the Controller service (--controller-url), the Node service "
                               "(--node-id), or both")
    services = proto.pb_grpc()
    server = grpc.server(ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="csi"))
    controller = None
    if cfg.api is not None:
        controller = ControllerService(cfg.api, node_vm=cfg.node_vm, capacity=cfg.api.can_read_capacity())
        services.add_ControllerServicer_to_server(controller, server)
    services.add_IdentityServicer_to_server(IdentityService(controller=controller is not None, ready=lambda: True),
                                            server)
    if cfg.node_id is not None:
        if not cfg.zone:
            raise InvalidParameter("the Node service needs --zone: the availability zone of this node's volumes")
        node = NodeService(NodeDevices(cfg.disk_dir), node_id=cfg.node_id, zone=cfg.zone)
        services.add_NodeServicer_to_server(node, server)
    _clear_socket(cfg.socket)
    cfg.socket.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    server.add_insecure_port(f"unix://{cfg.socket}")
    return server


def _clear_socket(path: Path) -> None:
    """A socket an earlier run left is removed; any other file there is refused."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidParameter(f"{path} exists and is not a socket")
    path.unlink()


def serve(cfg: CsiConfig) -> None:
    server = build(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _s, _f: stop.set())
    old = os.umask(0o077)  # the socket: its owner's only (the sidecars run as the same user)
    try:
        server.start()
    finally:
        os.umask(old)
    log.info("CSI driver serving on unix://%s (controller: %s, node: %s)", cfg.socket,
             "yes" if cfg.api is not None else "no", cfg.node_id or "no")
    stop.wait()
    log.info("stopping")
    server.stop(GRACE_S).wait()
    cfg.socket.unlink(missing_ok=True)
