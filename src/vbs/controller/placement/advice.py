"""Placement advice: run a VM's I/O against a remote volume, or move the VM, or move the volume?

``vbs advise VOL --instance I`` weighs, from the RTT probes hosts report (and the bench's
calibration, where the controller has one: vbs.controller.placement.rtt_model):

- staying remote: the workload's I/O at the RTT from the VM's host to the volume's node;
- migrate-instance: the VM's memory over the measured path, then the I/O from the host nearest the
  volume's node;
- migrate-volume: the volume's bytes at the copy throughput, then the I/O against the storage node
  nearest the VM's host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Instance, Node, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import host_info, is_alive, live_storage_nodes, storage_info
from vbs.controller.placement.rtt_model import Calibration, RemoteModel, from_probes, load_calibration
from vbs.controller.requests.attach_volume import instance_not_found
from vbs.controller.requests.describe_volumes import live_volume
from vbs.controller.rest.schemas.advice import AdviceModelOut, AdviceOption, AdviceOut, MeasuredProbe
from vbs.controller.runtime import Controller
from vbs.errors import IncorrectState
from vbs.wire.probes import Probe

GIB_MIB = 1024
Action = Literal["stay-remote", "migrate-instance", "migrate-volume"]


@dataclass(frozen=True)
class Workload:
    io_gib: float | None  # None: the volume's size, read or written once
    random_ios: int
    memory_mib: int


def _probes(s: Session, timeout_s: float) -> dict[str, dict[str, Probe]]:
    """Each live host's latest probe of each storage node."""
    now = utcnow()
    return {n.name: {p.storage_node: p for p in host_info(n).probes}
            for n in s.scalars(select(Node).where(Node.kind == "host")) if is_alive(n, timeout_s, now)}


def _protocol(node: Node | None) -> str:
    """The protocol the node serves hosts with, as its exports show; NBD (the default) if it has none."""
    exports = storage_info(node).exports if node is not None else []
    return exports[0].protocol if exports else "nbd"


def _model(probes: dict[str, dict[str, Probe]], calibration: Calibration | None, protocol: str) -> RemoteModel:
    measured = calibration.model(protocol) if calibration is not None else None
    if measured is not None:
        return measured
    return from_probes([(p.rtt_ms, p.mbps) for per_host in probes.values() for p in per_host.values()])


def _option(action: Action, host: str, node: str, rtt_ms: float, model: RemoteModel, *, mib: float, ios: int,
            move_s: float, command: str | None) -> AdviceOption:
    io_s = model.io_seconds(rtt_ms, mib=mib, ios=ios)
    return AdviceOption(action=action, host=host, storage_node=node, rtt_ms=rtt_ms,
                        mbps=round(model.mbps(rtt_ms), 3), iops=round(model.iops_at(rtt_ms), 1),
                        move_s=round(move_s, 4), io_s=round(io_s, 4), total_s=round(move_s + io_s, 4),
                        command=command)


def _breakeven(stay: AdviceOption, move: AdviceOption, io_gib: float) -> float | None:
    """The I/O (GiB) from which ``move`` costs less than ``stay``: I/O time scales with the workload."""
    saved_per_gib = (stay.io_s - move.io_s) / io_gib if io_gib > 0 else 0.0
    return round(move.move_s / saved_per_gib, 4) if saved_per_gib > 0 else None


def advise(svc: Controller, volume_id: str, instance_id: str, tenant: str, work: Workload) -> AdviceOut:
    calibration = load_calibration(svc.cfg.rtt_calibration_file)
    timeout = svc.cfg.heartbeat_timeout_s
    with svc.db.read() as s:
        vol: Volume = live_volume(s, volume_id, tenant)
        inst = s.get(Instance, ids.check("instance", instance_id))
        if inst is None or inst.state == "gone":
            raise instance_not_found(f"'{instance_id}'")
        probes = _probes(s, timeout)
        nodes = [n for n in live_storage_nodes(s, timeout) if not n.drained]
        protocol = _protocol(s.get(Node, (vol.storage_node, "storage")))
        size_gib, source_node, host = vol.size_gib, vol.storage_node, inst.host
    here = probes.get(host, {}).get(source_node)
    if here is None:
        raise IncorrectState(f"Host '{host}' has not measured its RTT to storage node '{source_node}' yet "
                             "(its agent probes every storage node once a minute).")
    model = _model(probes, calibration, protocol)
    io_gib = work.io_gib if work.io_gib is not None else float(size_gib)
    mib, ios = io_gib * GIB_MIB, work.random_ios
    stay = _option("stay-remote", host, source_node, here.rtt_ms, model, mib=mib, ios=ios, move_s=0.0, command=None)
    options = [stay]
    notes: list[str] = []

    near_hosts = sorted((p.rtt_ms, h) for h, per in probes.items() if h != host
                        for n, p in per.items() if n == source_node)
    if near_hosts:
        rtt, target = near_hosts[0]
        # The memory crosses the path between the VM's site and the data's: the one this host measured.
        move = _option("migrate-instance", target, source_node, rtt, model, mib=mib, ios=ios,
                       move_s=work.memory_mib / here.mbps,
                       command=f"vbs migrate-instance {instance_id} --host {target}")
        options.append(move.model_copy(update={"breakeven_io_gib": _breakeven(stay, move, io_gib)}))
    else:
        notes.append(f"no other live host has probed storage node {source_node}: moving the VM is not weighed")

    near_nodes = sorted((p.rtt_ms, n, p.mbps) for n, p in probes.get(host, {}).items()
                        if n != source_node and any(x.name == n for x in nodes))
    copy_mbps, copy_source = here.mbps, f"probe {host}->{source_node}"
    if calibration is not None and calibration.copy_mbps is not None:
        copy_mbps, copy_source = calibration.copy_mbps, "calibration"
    if near_nodes:
        rtt, target, target_mbps = near_nodes[0]
        if copy_source != "calibration" and target_mbps < copy_mbps:
            copy_mbps, copy_source = target_mbps, f"probe {host}->{target}"
        move = _option("migrate-volume", host, target, rtt, model, mib=mib, ios=ios,
                       move_s=size_gib * GIB_MIB / copy_mbps,
                       command=f"vbs migrate-volume {volume_id} --storage-node {target}")
        options.append(move.model_copy(update={"breakeven_io_gib": _breakeven(stay, move, io_gib)}))
    else:
        notes.append(f"host {host} has probed no other live storage node: moving the volume is not weighed")
    if model.window_mib is None:
        notes.append("the measurements span a single RTT: throughput is taken as the same at every RTT")
    best = min(options, key=lambda o: o.total_s)
    return AdviceOut(volume_id=volume_id, instance_id=instance_id, io_gib=io_gib, random_ios=ios,
                     memory_mib=work.memory_mib, options=options, recommended=best.action, notes=notes,
                     model=AdviceModelOut(source=model.source, protocol=protocol, link_mbps=round(model.link_mbps, 3),
                                          window_mib=model.window_mib, copy_mbps=round(copy_mbps, 3),
                                          copy_source=copy_source),
                     measured=[MeasuredProbe(host=h, storage_node=p.storage_node, rtt_ms=p.rtt_ms, mbps=p.mbps,
                                             measured_at=p.measured_at)
                               for h, per in sorted(probes.items()) for p in per.values()])
