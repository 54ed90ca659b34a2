"""Online resize of an attached volume, end to end on real daemons and a real guest.

The volume file grows in a file pool, the export driver (qemu-storage-daemon for NBD, tgtd for iSCSI)
makes a new export of it that reports the new size while the old one keeps serving, the QEMU driver
swaps the new connection under the guest's disk and resizes it, and the guest sees the larger disk
with its data intact, without a detach. Every daemon runs in tmp_path on a free loopback port and is
stopped by PID; what the guest sees is read in the guest (``/sys/block/vdX/size``, ``dd``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from tests.conftest import detached_after, free_port, private_qmp, start_bare_vm, stop_process, wait_until
from vbs.controller.fleet.agents import HostAgent, StorageAgent
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound, VbsError
from vbs.host.api import create_app as create_host_app
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.host.hypervisors.qemu_ids import DiskIds, disk_ids
from vbs.ids import virtio_serial
from vbs.net.web import ApiClient, agent_auth
from vbs.pools.exports import ExportDriver, FileSource
from vbs.rigs.testguest import TestGuest, build_guest, pattern_bytes, pattern_sha256
from vbs.rigs.testguest.guest import qmp_execute
from vbs.storage.api import create_app as create_storage_app
from vbs.storage.backends.file import FileBackend
from vbs.storage.exports.iscsi import IscsiExportDriver
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.system.argv import run
from vbs.trust.node_credentials import TokenSource
from vbs.wire.connection import Connection, HostIdentity, IscsiConnection, NbdConnection
from vbs.wire.host import QoS

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
HOST = HostIdentity(name="hv-1", address="127.0.0.1")


def vol(n: int) -> str:
    return f"vol-{n:017x}"


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resize") / "vms"  # its parent holds the VMs' test monitors
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def guest(vm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestGuest]:
    with TestGuest("guest1", vm_dir.parent, build_guest(), vm_dir) as g:  # test monitor: private_qmp()
        g.wait_ready(60)
        yield g


@pytest.fixture(scope="module")
def driver(vm_dir: Path, guest: TestGuest) -> QemuDriver:
    return QemuDriver(vm_dir, qmp_timeout=10.0, secrets_dir=vm_dir.parent / "vbs-secrets")


@pytest.fixture(autouse=True)
def leaves_the_guest_without_our_disks(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails before it detaches leaves the module's guest as the next test expects (its
    export fixtures, set up first, are torn down after this)."""
    yield from detached_after(request, "guest1", ("exports", "nbd_exports", "pool"))


def threads(driver: QemuDriver, ids: DiskIds) -> set[str]:
    """The disk's own I/O thread, which a driver with ``iothreads`` keeps beside its connection's objects."""
    return {ids.iothread} if driver.iothreads else set()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[FileBackend]:
    (tmp_path / "pool").mkdir()
    backend = FileBackend("pool1", tmp_path / "pool", clone_method="copy")
    yield backend
    backend.close()


def _stop_export_daemon(drv: NbdExportDriver | IscsiExportDriver, name: str) -> None:
    pid = drv.pid
    try:
        drv.stop()
    except DriverError:
        pass
    if pid is not None:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(name.encode()):
                os.kill(pid, signal.SIGKILL)  # by the PID we started, if stop() did not end it
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture(params=["nbd", "iscsi"])
def exports(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NbdExportDriver | IscsiExportDriver]:
    port = free_port()
    drv: NbdExportDriver | IscsiExportDriver
    if request.param == "nbd":
        drv = NbdExportDriver(tmp_path / "nbd-state", port=port)
    else:
        drv = IscsiExportDriver(tmp_path / "iscsi-state", port=port, control_port=port % 32768, session_grace=2.0)
    drv.start()
    yield drv
    _stop_export_daemon(drv, "qemu-storage-daemon" if request.param == "nbd" else "tgtd")


# -- what the storage clients and the guest see ------------------------------------------------------


def served(drv: ExportDriver, conn: Connection) -> dict[str, int]:
    """What a client of the export daemon can open now: export name (NBD) or LUN (iSCSI) -> bytes."""
    if isinstance(conn, NbdConnection):
        out = run(["nbdinfo", "--list", "--json", f"nbd://{conn.host}:{conn.port}"], timeout=30, check=False)
        if out.returncode != 0:
            return {}
        return {e["export-name"]: int(e["export-size"]) for e in json.loads(out.stdout)["exports"]}
    assert isinstance(conn, IscsiConnection) and conn.chap_secret is not None
    cred = f"{conn.chap_user}%{conn.chap_secret.get_secret_value()}@{conn.host}:{conn.port}"
    listing = run(["iscsi-ls", "-s", f"iscsi://{cred}"], timeout=30, check=False).stdout
    sizes: dict[str, int] = {}
    for line in listing.splitlines():
        if line.startswith("Lun:") and "DIRECT_ACCESS" in line:
            lun = line.split()[0].removeprefix("Lun:")
            cap = run(["iscsi-readcapacity16", f"iscsi://{cred}/{conn.iqn}/{lun}"], timeout=30).stdout
            sizes[lun] = int(cap.split("Total size:")[1].split()[0])
    return sizes


def key(conn: Connection) -> str:
    """The entry of ``served`` that ``conn`` opens."""
    return conn.export if isinstance(conn, NbdConnection) else str(conn.lun)  # type: ignore[union-attr]


def guest_size(guest: TestGuest, dev: str) -> int:
    return int(guest.check(f"cat /sys/block/{dev}/size").strip()) * 512


def write_at(guest: TestGuest, dev: str, seed: str, offset_mib: int, mib: int) -> str:
    guest.check(
        f"yes {seed} | head -c {mib * MIB} | dd of=/dev/{dev} bs=1M seek={offset_mib} conv=fsync 2>/dev/null",
        timeout=120,
    )
    return sha_at(guest, dev, offset_mib, mib)


def sha_at(guest: TestGuest, dev: str, offset_mib: int, mib: int) -> str:
    out = guest.check(
        f"echo 3 > /proc/sys/vm/drop_caches; "
        f"dd if=/dev/{dev} bs=1M skip={offset_mib} count={mib} iflag=direct 2>/dev/null | sha256sum",
        timeout=120,
    )
    return out.split()[0]


def file_at(path: Path, offset_mib: int, mib: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset_mib * MIB)
        return f.read(mib * MIB)


def vbs_nodes(vm_dir: Path, vm: str = "guest1") -> set[str]:
    nodes = qmp_execute(private_qmp(vm_dir, vm), "query-named-block-nodes", {"flat": True})
    return {n["node-name"] for n in nodes if n["node-name"].startswith("vbs-")}


def vbs_objects(vm_dir: Path, vm: str = "guest1") -> set[str]:
    objects = qmp_execute(private_qmp(vm_dir, vm), "qom-list", {"path": "/objects"})
    return {o["name"] for o in objects if o["name"].startswith("vbs-")}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


# -- the scenario --------------------------------------------------------------------------------------


def test_attached_volume_grows_online(
    exports: NbdExportDriver | IscsiExportDriver,
    pool: FileBackend,
    guest: TestGuest,
    driver: QemuDriver,
    vm_dir: Path,
) -> None:
    proto = exports.protocol
    volume_id = vol(0x100 if proto == "nbd" else 0x200)
    serial = virtio_serial(volume_id)
    ids = disk_ids(serial)
    pool.ensure_volume(volume_id, 64 * MIB)
    path = pool.volume_path(volume_id)

    c1 = exports.ensure_export(volume_id, FileSource(path), HOST)
    driver.attach("guest1", serial, c1)
    dev = guest.wait_for_disk(serial)
    assert guest.disk_size(serial) == guest_size(guest, dev) == 64 * MIB
    assert write_at(guest, dev, "head", 0, 4) == pattern_sha256("head", 4)
    assert write_at(guest, dev, "tail", 63, 1) == pattern_sha256("tail", 1)

    # 1. The file grows; the export the guest uses keeps its size (measured: it cannot change).
    pool.resize_volume(volume_id, 128 * MIB)
    assert path.stat().st_size == 128 * MIB
    assert served(exports, c1) == {key(c1): 64 * MIB}

    # 2. A new export of the same file reports the new size; the old one serves on, idempotently.
    c2, refresh_s = timed(lambda: exports.refresh_export(volume_id, FileSource(path), HOST.name))
    assert c2 != c1 and type(c2) is type(c1)
    assert served(exports, c2) == {key(c1): 64 * MIB, key(c2): 128 * MIB}
    assert exports.refresh_export(volume_id, FileSource(path), HOST.name) == c2
    assert exports.ensure_export(volume_id, FileSource(path), HOST) == c2  # what a new attach would be given
    assert [(e.key, e.host) for e in exports.list_exports()] == [(volume_id, HOST.name)]
    assert sha_at(guest, dev, 0, 4) == pattern_sha256("head", 4)  # still through the old export
    assert guest_size(guest, dev) == 64 * MIB

    # 3. The host swaps it under the disk: the guest sees 128 MiB, without a detach.
    disk, resize_s = timed(lambda: driver.resize("guest1", serial, c2, 128 * MIB))
    assert disk.serial == serial and disk.size_bytes == 128 * MIB and disk.connected
    started = time.monotonic()
    wait_until(lambda: guest_size(guest, dev) == 128 * MIB, 10, 0.05, what="the guest to see 128 MiB")
    seen_s = time.monotonic() - started
    assert guest.disks()[serial] == dev  # the same disk, never unplugged
    assert vbs_nodes(vm_dir) == {ids.raw, ids.proto2}
    assert vbs_objects(vm_dir) == ({ids.secret2} if proto == "iscsi" else set()) | threads(driver, ids)

    # 4. Old data intact, the new space writable, and it lands in the file.
    assert sha_at(guest, dev, 0, 4) == pattern_sha256("head", 4)
    assert sha_at(guest, dev, 63, 1) == pattern_sha256("tail", 1)
    assert write_at(guest, dev, "grown", 100, 8) == pattern_sha256("grown", 8)
    assert file_at(path, 100, 8) == pattern_bytes("grown", 8)
    rc, _ = guest.run(f"dd if=/dev/zero of=/dev/{dev} bs=1M seek=128 count=1 oflag=direct")
    assert rc != 0  # and no further than the new end

    # 5. Idempotent: same connection and size, nothing to do.
    _, again_s = timed(lambda: driver.resize("guest1", serial, c2, 128 * MIB))
    assert vbs_nodes(vm_dir) == {ids.raw, ids.proto2}

    # 6. Retire: exactly one export left, the one the guest uses.
    _, retire_s = timed(lambda: exports.retire_exports(volume_id, HOST.name))
    exports.retire_exports(volume_id, HOST.name)
    assert served(exports, c2) == {key(c2): 128 * MIB}
    assert sha_at(guest, dev, 100, 8) == pattern_sha256("grown", 8)

    # 7. Again: the ids alternate back, and the sizes keep adding up.
    pool.resize_volume(volume_id, 192 * MIB)
    c3 = exports.refresh_export(volume_id, FileSource(path), HOST.name)
    assert c3 != c2
    if isinstance(c3, IscsiConnection):
        assert (c1.lun, c2.lun, c3.lun) == (1, 2, 1)  # type: ignore[union-attr]  # LUN numbers alternate
    else:
        assert c3 != c1  # NBD export names are never reused
    driver.resize("guest1", serial, c3, 192 * MIB)
    wait_until(lambda: guest_size(guest, dev) == 192 * MIB, 10, 0.05, what="the guest to see 192 MiB")
    assert vbs_nodes(vm_dir) == {ids.raw, ids.proto}
    exports.retire_exports(volume_id, HOST.name)
    assert served(exports, c3) == {key(c3): 192 * MIB}
    assert write_at(guest, dev, "third", 190, 2) == pattern_sha256("third", 2)
    assert sha_at(guest, dev, 0, 4) == pattern_sha256("head", 4)

    # 8. Detach leaves nothing behind, in QEMU or the daemon.
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(vm_dir) == set() and vbs_objects(vm_dir) == set()
    exports.remove_export(volume_id, HOST.name)
    assert exports.list_exports() == []
    assert file_at(path, 190, 2) == pattern_bytes("third", 2)
    print(
        f"\n{proto}: refresh_export {refresh_s:.3f}s, QemuDriver.resize {resize_s:.3f}s, guest saw the size "
        f"{seen_s:.3f}s later, repeated resize {again_s:.3f}s, retire_exports {retire_s:.3f}s"
    )


def test_export_daemon_restart_between_refresh_and_resize(
    exports: NbdExportDriver | IscsiExportDriver,
    pool: FileBackend,
    guest: TestGuest,
    driver: QemuDriver,
    vm_dir: Path,
) -> None:
    """The export daemon is killed after the refresh: check() brings back both exports, the guest
    (reconnecting) keeps its data and still moves to the new one."""
    volume_id = vol(0x300 if exports.protocol == "nbd" else 0x400)
    serial = virtio_serial(volume_id)
    pool.ensure_volume(volume_id, 64 * MIB)
    path = pool.volume_path(volume_id)
    c1 = exports.ensure_export(volume_id, FileSource(path), HOST)
    driver.attach("guest1", serial, c1)
    dev = guest.wait_for_disk(serial)
    assert write_at(guest, dev, "kept", 0, 2) == pattern_sha256("kept", 2)
    pool.resize_volume(volume_id, 96 * MIB)
    c2 = exports.refresh_export(volume_id, FileSource(path), HOST.name)

    pid = exports.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
        10,
        what="the daemon to die",
    )
    exports.check()
    assert exports.pid not in (None, pid)
    # Both come back (re-created, the old one now with the file's size too).
    assert set(served(exports, c2)) == {key(c1), key(c2)}
    assert exports.refresh_export(volume_id, FileSource(path), HOST.name) == c2

    driver.resize("guest1", serial, c2, 96 * MIB)
    wait_until(lambda: guest_size(guest, dev) == 96 * MIB, 20, 0.1, what="the guest to see 96 MiB")
    assert sha_at(guest, dev, 0, 2) == pattern_sha256("kept", 2)
    exports.retire_exports(volume_id, HOST.name)
    assert served(exports, c2) == {key(c2): 96 * MIB}
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    exports.remove_export(volume_id, HOST.name)
    assert vbs_nodes(vm_dir) == set()


def test_tls_psk_nbd_grows_online(
    tmp_path: Path, pool: FileBackend, guest: TestGuest, driver: QemuDriver, vm_dir: Path
) -> None:
    """The new connection brings its own TLS credentials object; no key stays on disk."""
    drv = NbdExportDriver(tmp_path / "tls-state", port=free_port(), tls=True)
    try:
        volume_id = vol(0x900)
        serial = virtio_serial(volume_id)
        ids = disk_ids(serial)
        pool.ensure_volume(volume_id, 32 * MIB)
        path = pool.volume_path(volume_id)
        driver.attach("guest1", serial, drv.ensure_export(volume_id, FileSource(path), HOST))
        dev = guest.wait_for_disk(serial)
        assert write_at(guest, dev, "tls", 0, 1) == pattern_sha256("tls", 1)
        for size, gen in ((48 * MIB, 1), (64 * MIB, 0)):
            pool.resize_volume(volume_id, size)
            conn = drv.refresh_export(volume_id, FileSource(path), HOST.name)
            assert isinstance(conn, NbdConnection) and conn.tls_psk_key is not None
            driver.resize("guest1", serial, conn, size)
            wait_until(lambda size=size: guest_size(guest, dev) == size, 10, 0.05, what=f"{size} in the guest")
            assert vbs_objects(vm_dir) == {ids.generations[gen].tls} | threads(driver, ids)
            assert vbs_nodes(vm_dir) == {ids.raw, ids.generations[gen].proto}
            drv.retire_exports(volume_id, HOST.name)
            assert list(driver.secrets_dir.rglob("*")) == []
        assert sha_at(guest, dev, 0, 1) == pattern_sha256("tls", 1)
        assert write_at(guest, dev, "tls-end", 63, 1) == pattern_sha256("tls-end", 1)
        driver.detach("guest1", serial)
        guest.wait_disk_gone(serial)
        assert vbs_objects(vm_dir) == set() and vbs_nodes(vm_dir) == set()
        drv.remove_export(volume_id, HOST.name)
    finally:
        _stop_export_daemon(drv, "qemu-storage-daemon")


# -- host-side failure handling ----------------------------------------------------------------------


@pytest.fixture
def nbd_exports(tmp_path: Path) -> Iterator[NbdExportDriver]:
    drv = NbdExportDriver(tmp_path / "nbd-state", port=free_port())
    drv.start()
    yield drv
    _stop_export_daemon(drv, "qemu-storage-daemon")


def test_a_failed_resize_leaves_the_disk_on_its_old_connection(
    nbd_exports: NbdExportDriver, pool: FileBackend, guest: TestGuest, driver: QemuDriver, vm_dir: Path
) -> None:
    volume_id = vol(0x500)
    serial = virtio_serial(volume_id)
    ids = disk_ids(serial)
    pool.ensure_volume(volume_id, 32 * MIB)
    path = pool.volume_path(volume_id)
    c1 = nbd_exports.ensure_export(volume_id, FileSource(path), HOST)
    assert isinstance(c1, NbdConnection)
    driver.attach("guest1", serial, c1)
    dev = guest.wait_for_disk(serial)
    assert write_at(guest, dev, "safe", 0, 1) == pattern_sha256("safe", 1)
    before = (vbs_nodes(vm_dir), vbs_objects(vm_dir))

    def unchanged() -> None:
        assert (vbs_nodes(vm_dir), vbs_objects(vm_dir)) == before
        assert guest_size(guest, dev) == 32 * MIB
        assert write_at(guest, dev, "still", 1, 1) == pattern_sha256("still", 1)

    # An export nobody serves: blockdev-add fails, nothing was changed.
    nowhere = c1.model_copy(update={"export": f"{volume_id}-gone"})
    with pytest.raises(DriverError, match="blockdev-add"):
        driver.resize("guest1", serial, nowhere, 48 * MIB)
    unchanged()
    # More than the export has: a fresh node on it is added and swapped in, then block_resize fails
    # ("Cannot grow NBD nodes"): the swap is undone and the node deleted.
    with pytest.raises(DriverError, match="Cannot grow"):
        driver.resize("guest1", serial, c1, 48 * MIB)
    unchanged()
    with pytest.raises(InvalidParameter, match="shrink"):
        driver.resize("guest1", serial, c1, 16 * MIB)
    with pytest.raises(InvalidParameter):
        driver.resize("guest1", serial, c1, 48 * MIB + 1)
    with pytest.raises(NotFound):
        driver.resize("guest1", virtio_serial(vol(0x501)), c1, 48 * MIB)
    assert driver.resize("guest1", serial, c1, 32 * MIB).serial == serial  # already so: nothing to do
    unchanged()

    sock = private_qmp(vm_dir, "guest1")

    def add_nbd_node(node: str, c: NbdConnection) -> None:
        qmp_execute(
            sock,
            "blockdev-add",
            {
                "driver": "nbd",
                "node-name": node,
                "export": c.export,
                "discard": "unmap",
                "server": {"type": "inet", "host": c.host, "port": str(c.port)},
            },
        )

    # A resize interrupted after its new node was added (the agent killed): the next one drops it.
    pool.resize_volume(volume_id, 48 * MIB)
    c2 = nbd_exports.refresh_export(volume_id, FileSource(path), HOST.name)
    assert isinstance(c2, NbdConnection)
    add_nbd_node(ids.proto2, c2)
    driver.resize("guest1", serial, c2, 48 * MIB)
    wait_until(lambda: guest_size(guest, dev) == 48 * MIB, 10, 0.05, what="48 MiB in the guest")
    assert vbs_nodes(vm_dir) == {ids.raw, ids.proto2}
    assert sha_at(guest, dev, 0, 1) == pattern_sha256("safe", 1)
    nbd_exports.retire_exports(volume_id, HOST.name)

    # Interrupted after the reopen, before block_resize: the disk reads the new export but the guest
    # was never told. The next call finds it on that connection, tells the guest, drops the old node.
    pool.resize_volume(volume_id, 64 * MIB)
    c3 = nbd_exports.refresh_export(volume_id, FileSource(path), HOST.name)
    assert isinstance(c3, NbdConnection)
    add_nbd_node(ids.proto, c3)
    qmp_execute(
        sock,
        "blockdev-reopen",
        {
            "options": [
                {"driver": "raw", "node-name": ids.raw, "file": ids.proto, "read-only": False, "discard": "unmap"}
            ]
        },
    )
    assert guest_size(guest, dev) == 48 * MIB
    driver.resize("guest1", serial, c3, 64 * MIB)
    wait_until(lambda: guest_size(guest, dev) == 64 * MIB, 10, 0.05, what="64 MiB in the guest")
    assert vbs_nodes(vm_dir) == {ids.raw, ids.proto}
    nbd_exports.retire_exports(volume_id, HOST.name)
    assert write_at(guest, dev, "end", 63, 1) == pattern_sha256("end", 1)

    # Read-only disks: QEMU cannot show the guest a new size (block_resize: "Image is read-only").
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    nbd_exports.remove_export(volume_id, HOST.name)
    ro = nbd_exports.ensure_export(volume_id, FileSource(path), HOST, read_only=True)
    driver.attach("guest1", serial, ro, read_only=True)
    guest.wait_for_disk(serial)
    with pytest.raises(IncorrectState, match="read-only"):
        driver.resize("guest1", serial, ro, 64 * MIB)
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(vm_dir) == set()


def test_force_detach_after_a_resize_cuts_the_new_connection(
    nbd_exports: NbdExportDriver, pool: FileBackend, tmp_path: Path, vm_dir: Path, driver: QemuDriver
) -> None:
    """A guest that never releases the disk: the forced detach must find the swapped-in node."""
    proc = start_bare_vm(vm_dir, "bare", tmp_path / "bare.log")
    try:
        wait_until(private_qmp(vm_dir, "bare").exists, 10, what="the bare VM's QMP sockets")
        volume_id = vol(0x600)
        serial = virtio_serial(volume_id)
        ids = disk_ids(serial)
        pool.ensure_volume(volume_id, 16 * MIB)
        path = pool.volume_path(volume_id)
        driver.attach("bare", serial, nbd_exports.ensure_export(volume_id, FileSource(path), HOST))
        pool.resize_volume(volume_id, 32 * MIB)
        c2 = nbd_exports.refresh_export(volume_id, FileSource(path), HOST.name)
        driver.resize("bare", serial, c2, 32 * MIB)
        nbd_exports.retire_exports(volume_id, HOST.name)
        assert vbs_nodes(vm_dir, "bare") == {ids.raw, ids.proto2}
        driver.detach("bare", serial, force=True, timeout=1.0)
        nodes = vbs_nodes(vm_dir, "bare")
        assert ids.proto2 not in nodes and ids.proto not in nodes and ids.dead in nodes
        nbd_exports.remove_export(volume_id, HOST.name)  # nothing holds it any more
        assert nbd_exports.list_exports() == []
    finally:
        stop_process(proc)


# -- the agents' HTTP endpoints --------------------------------------------------------------------


class _Server:
    """An agent app served by uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ApiClient:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, 0.02, what="uvicorn")
        self.client = ApiClient(f"http://127.0.0.1:{self.port}", "t0ken", timeout=60)
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)


def test_the_controller_calls_over_http(
    exports: NbdExportDriver | IscsiExportDriver, tmp_path: Path, guest: TestGuest, driver: QemuDriver, vm_dir: Path
) -> None:
    """The calls the ModifyVolume workflow makes, through the controller's typed agent clients, against
    both agents' real apps."""
    volume_id = vol(0x700 if exports.protocol == "nbd" else 0x800)
    serial = virtio_serial(volume_id)
    (tmp_path / "pool").mkdir()
    pool = FileBackend("pool1", tmp_path / "pool", exports=exports, clone_method="copy")
    auth = agent_auth(TokenSource("t0ken"), insecure=False)
    storage_app = create_storage_app({"pool1": pool}, exports, auth, "storage-1")
    host_app = create_host_app(driver, auth, HOST.name)
    with _Server(storage_app) as storage_client, _Server(host_app) as host_client:
        storage, host = StorageAgent(storage_client, "storage-1", frozenset({"127.0.0.1"})), HostAgent(host_client)
        storage.ensure_volume("pool1", volume_id, 1, None)
        storage.resize_volume("pool1", volume_id, 1)
        c1 = storage.connection_for("pool1", volume_id, HOST, read_only=False).connection
        # With QoS: the raw node that is reopened sits under a throttle node, which is resized.
        attached = host.attach("guest1", serial, c1, read_only=False, qos=QoS(iops=100_000))
        assert attached.serial == serial and disk_ids(serial).throttle in vbs_nodes(vm_dir)
        dev = guest.wait_for_disk(serial)
        assert write_at(guest, dev, "http", 0, 1) == pattern_sha256("http", 1)

        storage.resize_volume("pool1", volume_id, 2)
        c2 = storage.refresh_connection("pool1", volume_id, HOST.name)
        assert c2 != c1 and c2.protocol == exports.protocol
        disk = host.resize("guest1", serial, c2, 2)
        assert disk.serial == serial and disk.read_only is False
        wait_until(lambda: guest_size(guest, dev) == 2 << 30, 10, 0.05, what="2 GiB in the guest")
        storage.retire_connections("pool1", volume_id, HOST.name)
        storage.retire_connections("pool1", volume_id, HOST.name)
        assert sha_at(guest, dev, 0, 1) == pattern_sha256("http", 1)

        # Bad input is refused before any driver call.
        base = f"/v1/pools/pool1/volumes/{volume_id}/connections"
        for method, path, body in (
            ("PUT", f"{base}/{HOST.name}", {"host": HOST.model_dump(), "extra": 1}),
            ("PUT", f"/v1/pools/pool1/volumes/vol-nothex/connections/{HOST.name}/refresh", None),
            ("PUT", f"{base}/Bad_Host/refresh", None),
            ("DELETE", f"{base}/Bad_Host/retired", None),
        ):
            with pytest.raises(VbsError) as err:
                storage_client.call(method, path, body)
            assert err.value.status == 400, err.value.message
        with pytest.raises(NotFound):
            storage.refresh_connection("pool1", volume_id, "hv-none")
        raw_c2 = c2.model_dump(mode="json")
        for body in (
            {"connection": raw_c2, "size_bytes": 100},
            {"connection": raw_c2, "size_bytes": (2 << 30) + 1},
            {"connection": raw_c2},
            {"connection": raw_c2, "size_bytes": 2 << 30, "read_only": True},
            {"connection": {"protocol": "nfs"}, "size_bytes": 2 << 30},
        ):
            with pytest.raises(VbsError) as err:
                host_client.call("PUT", f"/v1/vms/guest1/disks/{serial}/size", body)
            assert err.value.status in (400, 422), err.value.message
        with pytest.raises(VbsError) as err:
            host_client.call("PUT", "/v1/vms/guest1/disks/vol-dash/size", {"connection": raw_c2, "size_bytes": 2 << 30})
        assert err.value.status == 400
        with pytest.raises(NotFound):
            host.resize("guest1", virtio_serial(vol(0x9)), c2, 2)

        host.detach("guest1", serial, force=False, timeout=10)
        guest.wait_disk_gone(serial)
        storage.remove_connection("pool1", volume_id, HOST.name)
        assert storage.list_exports() == []
    pool.close()
