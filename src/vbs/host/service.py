"""Running the host agent: its hypervisor driver found by name in the registry, its API and heartbeat."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from vbs import drivers
from vbs.config import HostAgentConfig
from vbs.errors import DriverError, VbsError
from vbs.host.api import create_app
from vbs.host.full_storage import SpaceWaits
from vbs.host.hypervisors.base import (
    HypervisorDriver,
    LimitingDriver,
    MigratingDriver,
    MirroringDriver,
    PausingDriver,
    SpaceWaitingDriver,
)
from vbs.host.local_pools import CopyCredentials, LocalPools, build_local_pools
from vbs.host.pauses import Pauses
from vbs.host.probes import Prober
from vbs.net.heartbeat import Heartbeat
from vbs.net.web import BoundedServer, serve_agent
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.trust import agent_security
from vbs.wire.host import HostHeartbeat, VmInfo

log = logging.getLogger(__name__)

# What a driver declares it can do is its contract, each capability with the calls it needs: checked
# once here, the API then asks the capability alone.
_CAPABILITY_CALLS: dict[str, type] = {"qos": LimitingDriver, "pause": PausingDriver,
                                      "live_migration": MigratingDriver, "mirror": MirroringDriver}


def build_driver(cfg: HostAgentConfig) -> HypervisorDriver:
    driver_cls: Any = drivers.load("hypervisor", cfg.hypervisor)
    driver = driver_cls.from_config(cfg)
    if not isinstance(driver, HypervisorDriver):
        raise DriverError(f"hypervisor driver {cfg.hypervisor!r} does not fulfil the HypervisorDriver contract")
    for capability, calls in _CAPABILITY_CALLS.items():
        if getattr(driver.capabilities, capability) and not isinstance(driver, calls):
            raise DriverError(f"hypervisor driver {cfg.hypervisor!r} declares {capability} but does not fulfil "
                              f"{calls.__name__}")
    return driver


def copy_credentials(cfg: HostAgentConfig, state: Path | None) -> CopyCredentials:
    """Where the local pools' copies keep key files for a moment, and the host's X.509 client credentials."""
    secrets = (state or cfg.vm_dir.resolve()) / ".vbs-local-copies"
    x509 = X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    return CopyCredentials(secrets, qemu_x509_dir(x509, secrets / "x509", "client") if x509 else None)


def serve(cfg: HostAgentConfig) -> None:
    state = cfg.state_dir.resolve() if cfg.state_dir is not None else None
    sec = agent_security.prepare("host agent", cfg, *([state] if state else []),
                                 node_name=cfg.node_name, fence_file=state / "fences.json" if state else None)
    driver = build_driver(cfg)
    pauses = Pauses(cast(PausingDriver, driver), state) if driver.capabilities.pause else None
    if pauses is not None:
        pauses.recover()
    space_waits = SpaceWaits(driver) if isinstance(driver, SpaceWaitingDriver) else None
    if space_waits is not None:
        space_waits.start()
    local = LocalPools(build_local_pools(cfg), copy_credentials(cfg, state))
    app = create_app(driver, sec.auth, cfg.node_name, pauses, local)
    url = cfg.advertise_url or f"{sec.scheme}://{cfg.host}:{cfg.port}"
    started_at = datetime.now(UTC)
    prober: Prober | None = None
    if cfg.probe_interval_s > 0:
        prober = Prober(sec.controller(cfg.controller_url, label=f"host agent {cfg.node_name} probes"),
                        interval_s=cfg.probe_interval_s, probe_bytes=cfg.probe_bytes,
                        verify=sec.tls.client_context() if sec.tls is not None else True)

    def report() -> HostHeartbeat:
        vms: list[VmInfo] | None
        try:
            vms = driver.list_vms()
        except VbsError as exc:
            log.warning("listing VMs failed: %s", exc.message)
            vms = None  # unknown this time: the controller keeps what it knew
        return HostHeartbeat(name=cfg.node_name, url=url, address=cfg.address, initiator_name=cfg.initiator_name,
                             hypervisor=cfg.hypervisor, capabilities=driver.capabilities, started_at=started_at,
                             vms=vms, probes=prober.latest() if prober is not None else [],
                             local_pools=[b.pool_info() for b in local.backends.values()])

    def heartbeat(server: BoundedServer) -> Heartbeat:
        controllers = sec.controller(cfg.controller_url, label=f"host agent {cfg.node_name}")
        if prober is not None:
            prober.start()
        return Heartbeat(controllers, "/internal/v1/host-heartbeat", report,
                         interval=cfg.heartbeat_interval_s, ready=lambda: server.started)

    log.info("host agent %s serving on %s (hypervisor %s, local pools %s)", cfg.node_name, url, cfg.hypervisor,
             ", ".join(local.backends) or "none")
    def shutdown() -> None:
        if space_waits is not None:
            space_waits.stop()
        if prober is not None:
            prober.stop()
        if pauses is not None:
            pauses.close()
        driver.close()
        local.close()

    serve_agent(app, cfg.host, cfg.port, heartbeat=heartbeat, shutdown=shutdown, tls=sec.tls)
