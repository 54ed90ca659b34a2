"""The clouds the end-to-end tests run on, in one place: a real ``vbs up`` (controller, storage agent
``storage-1``, host agent ``host-1``), whatever a test module starts beside it (more host agents, another
controller, booted test guests, bare VMs), and what the tests ask of it all (instances, exports, a VM's
disks as its host agent sees them, the export daemon's PID, the controller's test hooks).

A test module keeps only what is its own: which guests on which hosts, its flags, its own checks.

A cloud is a context manager. Everything it started is stopped by its PID when its ``with`` block ends
(or its start fails), the last started first, whatever one of them raised; ``vbs up``'s stop reaps the
export daemons it leaves. The environment a cloud is given goes to the processes it starts, never into
this process's ``os.environ``.

* ``Cloud``: ``vbs up`` alone, and the ways to start more beside it;
* ``TwoHostCloud``: with a second host agent (``host-2``) and a booted guest on each host (``vm1``, ``vm2``);
* ``LibvirtCloud``: ``vbs up`` whose host agent drives libvirt, and domains of the test guest;
* ``Reusable``: one cloud for a module's tests, started afresh for the next test after one failed in it;
* ``new_volume``, ``detach_is_busy_until_forced``, ``bare_domain_named``: what the attach tests of every
  hypervisor driver share.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from tests.conftest import VBS, Vbs, VbsUp, node_token, start_bare_vm, stop_bare_vm, stop_process, wait_until
from vbs.net.ports import free_port
from vbs.rigs.testguest import TestGuest, build_guest

if TYPE_CHECKING:
    from tests.libvirtd import Libvirtd
    from vbs.rigs.testguest.libvirt import LibvirtGuest

T = TypeVar("T")


class Cloud:
    """``vbs up`` in ``tmp/var`` (its log ``tmp/up.log``) with ``extra`` flags; ``env``: more environment
    for every process the cloud starts. A subclass starts its own processes in ``start``."""

    vbs: Vbs  # once started

    def __init__(self, tmp: Path, *, extra: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = dict(env or {})
        self.up = VbsUp(tmp / "var", tmp / "up.log", extra=list(extra), env=self.env)
        self.stack = ExitStack()  # how to stop what was started, last first

    # -- starting and stopping ------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stack.close()

    def start(self) -> None:
        """``vbs up``; a subclass starts what is its own after it (``super().start()`` first)."""
        self.stack.callback(self.up.stop)
        self.vbs = self.up.start()

    def started(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """``proc``, to be stopped by its PID when the cloud stops (at once if it has exited already)."""
        self.stack.callback(stop_process, proc)
        return proc

    def process_env(self, **more: str) -> dict[str, str]:
        """The environment of a process this cloud starts: this one's, the cloud's ``env``, and ``more``."""
        return {**os.environ, **self.env, **more}

    def vm_dir(self, host: str) -> Path:
        """Where the VMs of ``host`` have their QMP sockets: in the data dir for vbs up's own host agent
        (``host-1``), ``vms-<n>`` beside it for ``host-<n>``."""
        if host == "host-1":
            return self.vbs.data_dir / "vms"
        return self.tmp / f"vms-{host.removeprefix('host-')}"

    def start_host_agent(self, name: str) -> subprocess.Popen[bytes]:
        """A host agent ``name`` beside vbs up's, with its node token, its VMs in ``vm_dir(name)`` and its
        output in ``<name>.log``. A test that stops it may start it again the same way."""
        vm_dir = self.vm_dir(name)
        vm_dir.mkdir(parents=True, exist_ok=True)
        with (self.tmp / f"{name}.log").open("ab") as log:
            return self.started(subprocess.Popen(
                [*VBS, "host-agent", "--node-name", name, "--port", str(free_port()), "--controller-url",
                 self.vbs.endpoint, "--vm-dir", str(vm_dir)],
                env=self.process_env(VBS_AGENT_TOKEN=node_token(self.vbs.data_dir, "host", name)), stdout=log,
                stderr=subprocess.STDOUT))

    def start_guests(self, where: Mapping[str, str]) -> list[TestGuest]:
        """Boot a test guest (QEMU, TCG) for each ``{vm: host}`` at once, its QMP socket in its host's VM
        dir; returned in that order once each is ready."""
        image = build_guest()
        guests = [TestGuest(vm, self.tmp / "guests", image, self.vm_dir(host)) for vm, host in where.items()]
        for guest in guests:
            self.stack.callback(guest.stop)
            guest.start()
        for guest in guests:
            guest.wait_ready(120)
        return guests

    def start_bare_vm(self, vm: str, host: str) -> subprocess.Popen[bytes]:
        """A QEMU without a guest OS on ``host`` (it takes hot-plugged disks and never releases one)."""
        vm_dir = self.vm_dir(host)
        vm_dir.mkdir(parents=True, exist_ok=True)
        vm_proc = start_bare_vm(vm_dir, vm, self.tmp / f"{vm}.log")
        self.stack.callback(stop_bare_vm, vm_proc)
        return vm_proc

    # -- what the tests ask -------------------------------------------------------------------------------------

    def instance(self, host: str, vm: str, timeout: float = 30) -> str:
        """The instance id of ``vm`` on ``host``, once its host agent reported it running."""
        def find() -> str | None:
            for i in self.vbs.http.get("/v1/instances").json()["instances"]:
                if i["host"] == host and i["vm_id"] == vm and i["state"] == "running":
                    return str(i["instance_id"])
            return None

        return wait_until(find, timeout, what=f"instance {vm} on {host}")  # type: ignore[no-any-return]

    def instance_ids(self, where: Mapping[str, str], timeout: float = 60) -> dict[str, str]:
        """``{vm: instance id}`` of each ``{vm: host}``, once every one is reported running."""
        def found() -> dict[str, str] | None:
            running = {i["vm_id"]: i["instance_id"] for i in self.vbs.http.get("/v1/instances").json()["instances"]
                       if i["state"] == "running" and where.get(i["vm_id"]) == i["host"]}
            return running if set(running) == set(where) else None

        return wait_until(found, timeout, what=f"{len(where)} instances")  # type: ignore[no-any-return]

    def attachment_state(self, volume_id: str) -> str | None:
        atts = self.vbs.volume(volume_id)["attachments"]
        return atts[0]["state"] if atts else None

    def agent_url(self, kind: str, name: str) -> str:
        """The URL of node ``name`` (``kind``: storage or host), as the controller knows it."""
        path, key = ("/v1/storage-nodes", "storage_nodes") if kind == "storage" else ("/v1/hosts", "hosts")
        return str(next(n["url"] for n in self.vbs.http.get(path).json()[key] if n["name"] == name))

    @property
    def storage_auth(self) -> dict[str, str]:
        """The storage agent's credentials (its node token), which its API and the controller's internal one take."""
        return {"authorization": "Bearer " + node_token(self.vbs.data_dir, "storage", "storage-1")}

    def exports(self) -> list[dict[str, str]]:
        """The exports the storage agent says it serves."""
        import httpx

        r = httpx.get(f"{self.agent_url('storage', 'storage-1')}/v1/exports", headers=self.storage_auth, timeout=10)
        r.raise_for_status()
        return r.json()["exports"]  # type: ignore[no-any-return]

    def host_disks(self, vm: str, host: str = "host-1") -> list[dict[str, Any]]:
        """What the host agent (its hypervisor driver) reports attached to ``vm``: a disk is listed as long
        as the VM has its device, also once a forced detach cut it off (``connected: false``) until the
        guest lets go of it."""
        import httpx

        r = httpx.get(f"{self.agent_url('host', host)}/v1/vms/{vm}/disks", timeout=30,
                      headers={"authorization": f"Bearer {node_token(self.vbs.data_dir, 'host', host)}"})
        assert r.status_code == 200, r.text
        return r.json()["disks"]  # type: ignore[no-any-return]

    def export_daemon_pid(self) -> int | None:
        """The PID of the storage agent's running export daemon (qemu-storage-daemon or tgtd), if any."""
        for pidfile in (self.vbs.data_dir / "storage-state").rglob("*.pid"):
            try:
                pid = int(pidfile.read_text().strip())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                status = Path(f"/proc/{pid}/status").read_text()
            except (OSError, ValueError):
                continue
            if (b"qemu-storage-daemon" in cmdline or b"tgtd" in cmdline) and "State:\tZ" not in status:
                return pid
        return None

    def hook(self, action: str, kind: str, step: str) -> Any:
        """One of the controller's step hooks (``VBS_TEST_HOOKS=1``); the internal API takes a node's token."""
        r = self.vbs.http.post(f"/internal/v1/test/{action}", json={"kind": kind, "step": step},
                               headers=self.storage_auth, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()


class TwoHostCloud(Cloud):
    """vbs up (host-1, with the booted guest vm1) and a second host agent (host-2, with the guest vm2)."""

    vm1: TestGuest
    vm2: TestGuest
    host2: subprocess.Popen[bytes]  # a test that stops host-2 puts the one it starts again here

    def start(self) -> None:
        super().start()
        self.host2 = self.start_host_agent("host-2")
        where = {"vm1": "host-1", "vm2": "host-2"}
        self.vm1, self.vm2 = self.start_guests(where)
        self.instance_ids(where)


# How long a detach waits for a guest to release its disk. The default (10 s) on purpose, not less: a TCG guest
# on a loaded machine takes seconds to answer an unplug, and a shorter wait turned such a detach into
# "did not release" (the one test of a guest that never releases a disk waits it out once).
GUEST_DETACH_ENV = {"VBS_CONTROLLER_DETACH_TIMEOUT_S": "10"}


class LibvirtCloud(Cloud):
    """``vbs up --export EXPORT EXTRA`` whose host agent drives libvirt (``EXTRA``: ``--hypervisor ...``),
    and a transient domain of the test guest for each of ``vms`` (``vm1`` the first, ``vm2`` the last)."""

    vm1: LibvirtGuest
    vm2: LibvirtGuest

    def __init__(self, tmp: Path, export: str, libvirtd: Libvirtd, vms: Sequence[str], extra: Sequence[str],
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(tmp, extra=["--export", export, *extra], env={**GUEST_DETACH_ENV, **(env or {})})
        self.export, self.libvirtd, self.vm_names = export, libvirtd, tuple(vms)

    def start(self) -> None:
        from vbs.rigs.testguest.libvirt import LibvirtGuest

        super().start()
        image = build_guest()
        # Started after the host agent connected to libvirtd: they come to it as lifecycle events.
        guests = [LibvirtGuest(name, self.tmp / "guests", image) for name in dict.fromkeys(self.vm_names)]
        for guest in guests:
            self.stack.callback(guest.stop)
        for guest in guests:
            guest.start()
        for guest in guests:
            guest.wait_ready(120)
        self.vm1, self.vm2 = guests[0], guests[-1]

    def new_volume(self) -> str:
        return new_volume(self)


class Reusable(Generic[T]):
    """One cloud for a module's tests, started when a test first asks for it (``get``); a test that
    failed in it calls ``discard``, and the next one gets a fresh cloud (``start(n)`` makes the n-th)."""

    def __init__(self, start: Callable[[int], AbstractContextManager[T]]) -> None:
        self._start = start
        self._stack: ExitStack | None = None
        self._cloud: T | None = None
        self.count = 0

    def get(self) -> T:
        if self._cloud is None:
            self.count += 1
            self._stack = ExitStack()
            try:
                self._cloud = self._stack.enter_context(self._start(self.count))
            except BaseException:
                self.discard()
                raise
        return self._cloud

    def discard(self) -> None:
        stack, self._stack, self._cloud = self._stack, None, None
        if stack is not None:
            stack.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.discard()


# -- what the attach tests of every hypervisor driver share ---------------------------------------------------------


def new_volume(c: Cloud, size: int = 1, **extra: Any) -> str:
    """A new volume, made by the CLI (``extra["args"]``: more of its arguments), once available."""
    vol = c.vbs.cli("create-volume", "--size", str(size), "--wait", *[str(x) for x in extra.get("args", [])])
    return str(vol["volume_id"])


def detach_is_busy_until_forced(cloud: Cloud, vm: str) -> None:
    """Attach a volume to ``vm`` on host-1, a VM that never releases a disk: detach is ``busy`` and
    keeps the export; ``--force`` ends the attachment and removes the export."""
    vol_id = new_volume(cloud)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", vm, "--wait")
    proc = cloud.vbs.cli("detach-volume", vol_id, "--wait", check=False)
    assert proc.returncode == 1, proc.stdout
    assert cloud.attachment_state(vol_id) == "busy"
    assert cloud.vbs.volume(vol_id)["status"] == "in-use"
    assert [e["key"] for e in cloud.exports()] == [vol_id], "the export stays while the guest holds it"

    det = cloud.vbs.cli("detach-volume", vol_id, "--force", "--wait")
    assert det["state"] == "detached"
    assert cloud.vbs.volume(vol_id)["status"] == "available"
    assert cloud.exports() == []


@contextmanager
def bare_domain_named(cloud: Cloud, name: str) -> Iterator[str]:
    """A domain with no OS on host-1: it takes a hot-plugged disk but never acknowledges an unplug."""
    import libvirt

    from tests.libvirtd import URI
    from vbs.rigs.testguest.libvirt import domain_xml

    conn = libvirt.open(URI)
    dom = conn.createXML(domain_xml(name, None, None, 64), 0)
    try:
        cloud.instance("host-1", name)
        yield name
    finally:
        dom.destroy()
        conn.close()
