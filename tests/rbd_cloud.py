"""A cloud on RBD volumes for the tests: a controller, a storage agent ``--backend rbd --export nbd``
on one pool of a test Ceph, a host agent and a TCG guest that reads and writes its disks.

Every process is this test's child, stopped by PID at the end.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.ceph_cluster import CephForTests
from tests.conftest import Services, Vbs, wait_until
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

MIB = 1 << 20


def rbd_json(conf: Path, *args: str) -> Any:
    """What ``rbd ARGS --format json`` answers (as client.admin of the cluster ``conf`` names)."""
    proc = subprocess.run(["rbd", "--conf", str(conf), *args, "--format", "json"], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f"rbd {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout or "null")


def rbd_export_sha256(conf: Path, spec: str, mib: int) -> str:
    """sha256 of the first ``mib`` MiB of the image ``pool/image[@snap]`` as ``rbd export`` reads it."""
    proc = subprocess.Popen(["rbd", "--conf", str(conf), "export", spec, "-"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    digest, left = hashlib.sha256(), mib * MIB
    try:
        while left > 0 and (chunk := proc.stdout.read(min(left, MIB))):
            digest.update(chunk)
            left -= len(chunk)
    finally:
        proc.kill()
        proc.wait(60)
    assert left == 0, f"rbd export of {spec} ended {left} bytes short"
    return digest.hexdigest()


@dataclass
class RbdCloud:
    svc: Services
    ceph: CephForTests
    pool: str
    guest: TestGuest
    agent_args: tuple[str, ...] = ()
    host_config: Path | None = None

    @property
    def vbs(self) -> Vbs:
        return self.svc.vbs

    def rbd(self, *args: str) -> Any:
        """What the rbd tool answers in JSON."""
        return rbd_json(self.ceph.conf_path, *args)

    def export_sha256(self, image: str, mib: int) -> str:
        return rbd_export_sha256(self.ceph.conf_path, f"{self.pool}/{image}", mib)

    def attach(self, volume_id: str, device: str) -> str:
        self.vbs.cli("attach-volume", volume_id, "--host", "host-1", "--vm", self.guest.name, "--device", device,
                     "--wait")
        return self.guest.wait_for_disk(virtio_serial(volume_id), 60)

    def exported_over_nbd(self, volume_id: str) -> bool:
        """Whether the guest's disk of the volume is an NBD node (else QEMU opened the image itself)."""
        nodes = self.guest.qmp("query-named-block-nodes", {"flat": True})
        serial = virtio_serial(volume_id)
        return any(serial in n["node-name"] and n["drv"] == "nbd" for n in nodes)

    def detach(self, volume_id: str) -> None:
        assert self.vbs.cli("detach-volume", volume_id, "--wait")["state"] == "detached"
        self.guest.wait_disk_gone(virtio_serial(volume_id), 60)

    def snapshot(self, volume_id: str) -> str:
        r = self.vbs.http.post("/v1/snapshots", json={"volume_id": volume_id})
        assert r.status_code == 200, r.text
        return str(self.vbs.wait_snapshot(r.json()["snapshot_id"], "completed", timeout=120)["snapshot_id"])

    def assert_consistent(self) -> None:
        """The reconciler's check (inventory, exports, disks against the DB) finds nothing."""
        report = self.vbs.http.get("/v1/admin/check").json()
        assert report["clean"], report["findings"]

    def restart_agent(self) -> None:
        """The storage agent again, as it ran (after the test killed it)."""
        self.svc.start_agent(*self.agent_args)

    def restart_host_agent(self) -> None:
        self.svc.start_host_agent("host-1", self.host_config)

    def new_volume(self, **body: object) -> str:
        vol = self.vbs.create_volume(**body)["volume_id"]
        self.vbs.wait_volume(vol, "available", timeout=120)
        return str(vol)


@contextmanager
def running_rbd_cloud(ceph: CephForTests, pool: str, tmp_path: Path, *, native: bool = False,
                      **env: str) -> Iterator[RbdCloud]:
    """The cloud on ``pool``, with the guest ``vm1`` running on ``host-1``. ``native``: the host's QEMU
    opens RBD itself; else its driver lists no ``rbd`` and volumes reach it through the storage
    agent's NBD export. ``env``: more environment for every process (e.g. the controller's settings)."""
    svc = Services(tmp_path)
    svc.env = {**svc.env, **env}
    guest: TestGuest | None = None
    host_config = None
    if not native:
        tmp_path.mkdir(parents=True, exist_ok=True)
        host_config = tmp_path / "host.toml"
        host_config.write_text('[host_agent.options.qemu]\nprotocols = ["nbd", "iscsi"]\n')
    try:
        svc.start_controller()
        agent_args = ("--backend", "rbd", "--export", "nbd", "--ceph-conf", str(ceph.conf_path),
                      "--ceph-user", "admin", "--rbd-pool", pool)
        svc.start_agent(*agent_args)
        vm_dir = svc.start_host_agent("host-1", host_config)
        guest = TestGuest("vm1", tmp_path / "guests", build_guest(), vm_dir)
        guest.start()
        guest.wait_ready(120)
        wait_until(lambda: any(i["vm_id"] == "vm1" and i["state"] == "running"
                               for i in svc.vbs.http.get("/v1/instances").json()["instances"]), 60, what="guest")
        yield RbdCloud(svc, ceph, pool, guest, agent_args, host_config)
    finally:
        if guest is not None:
            guest.stop()
        svc.stop()
