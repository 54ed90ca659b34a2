"""RBD volumes served to hosts through an export: qemu-storage-daemon (NBD) or tgtd's rbd backing
store (iSCSI) opens the image itself, for hypervisors that cannot open RBD natively.

The integration tests run the rbd backend on the session's real single-node Ceph with a real
qemu-storage-daemon or tgtd (stopped by PID at teardown) and read and write through the export with
qemu-io. The unit tests check how an ``RbdSource`` is validated.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ceph_cluster import CephForTests
from tests.export_fixtures import MiB, drivers_of
from tests.test_iscsi_export import qemu_io as iscsi_io
from tests.test_iscsi_export import tgtd_driver
from tests.test_nbd_export import qemu_io
from vbs import ids
from vbs.errors import IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.pools.exports import FileSource, RbdSource
from vbs.storage.backends.rbd import RbdBackend
from vbs.storage.exports.iscsi import IscsiExportDriver
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.wire.connection import HostIdentity, IscsiConnection, NbdConnection

QSD = "qemu-storage-daemon"
HOST = HostIdentity(name="hv-a", address="127.0.0.1")


# -- RbdSource (unit) ----------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("field,value", [
    ("pool", "rbd/ns"), ("pool", "-rbd"), ("pool", "rbd\n"), ("pool", ""),
    ("image", "vol-1@snap"), ("image", "a/b"), ("image", "vol,conf=/x"), ("image", "x" * 200),
    ("user", "admin key=abc"), ("user", "admin\n"), ("conf", "ceph.conf"),
])
def test_an_rbd_source_with_a_bad_field_is_refused(field: str, value: str) -> None:
    good: dict[str, object] = {"pool": "rbd", "image": "vol-0123456789abcdef0", "conf": Path("/etc/ceph/ceph.conf"),
                               "user": "admin"}
    good[field] = Path(value) if field == "conf" else value
    with pytest.raises(InvalidParameter):
        RbdSource(**good)  # type: ignore[arg-type]


@pytest.mark.unit
def test_an_rbd_source_is_named_by_its_image_not_its_size() -> None:
    a = RbdSource("rbd", "vol-0123456789abcdef0", Path("/c/ceph.conf"), "admin", size_bytes=1)
    b = RbdSource("rbd", "vol-0123456789abcdef0", Path("/c/ceph.conf"), "admin", size_bytes=2)
    assert a == b


@pytest.mark.unit
def test_the_iscsi_export_refuses_a_ceph_conf_path_that_tgtd_would_split(tmp_path: Path) -> None:
    odd = tmp_path / "a;b"
    odd.mkdir()
    conf = odd / "ceph.conf"
    conf.write_text("[global]\n")
    drv = IscsiExportDriver(tmp_path / "state", port=3260)
    src = RbdSource("rbd", "vol-0123456789abcdef0", conf, "admin", size_bytes=MiB)
    with pytest.raises(InvalidParameter, match="must not contain"):
        drv.ensure_export("vol-0123456789abcdef0", src, HOST)
    assert drv.pid is None  # refused before any daemon ran


# -- the NBD export of a real image (integration) ----------------------------------------------------


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, QSD)


@pytest.fixture
def served(ceph: CephForTests, make_driver: Callable[..., NbdExportDriver]) -> Iterator[RbdBackend]:
    backend = RbdBackend("default", ceph.conf_path, rbd_pool=ceph.new_pool(), exports=make_driver())
    yield backend
    backend.close()


def _io(c: object, cmd: str) -> str:
    """One qemu-io command through the connection's protocol; its output (it must succeed)."""
    if isinstance(c, NbdConnection):
        rc, out = qemu_io(c, cmd)
    else:
        assert isinstance(c, IscsiConnection)
        rc, out = iscsi_io(c, cmd)
    assert rc == 0, out
    return out


@pytest.mark.integration
def test_a_volume_written_through_its_nbd_export_is_in_its_image_and_its_clone(served: RbdBackend) -> None:
    vol, snap, clone = ids.new_id("volume"), ids.new_id("snapshot"), ids.new_id("volume")
    served.ensure_volume(vol, 64 * MiB)
    c = served.connection_for(vol, HOST)
    _io(c, "write -P 0x5a 1M 1M")
    assert served.ensure_snapshot(snap, vol).state == "ready"  # taken while the daemon has the image open
    _io(c, "write -P 0x11 1M 1M")  # after the snapshot: the clone must not see it
    served.ensure_volume(clone, 64 * MiB, snap)
    cc = served.connection_for(clone, HOST)
    assert "Pattern verification failed" not in _io(cc, "read -P 0x5a 1M 1M")
    assert "Pattern verification failed" not in _io(c, "read -P 0x11 1M 1M")
    served.remove_connection(vol, HOST.name)
    served.remove_connection(clone, HOST.name)
    assert served.exports is not None and served.exports.list_exports() == []
    served.remove_volume(vol)  # no watcher left: the image goes (to the trash: its snapshot remains)
    assert served.inventory().volumes == [clone]


@pytest.mark.integration
def test_the_same_host_gets_the_same_connection_and_a_grow_gets_a_new_one(served: RbdBackend) -> None:
    vol = ids.new_id("volume")
    served.ensure_volume(vol, 16 * MiB)
    first = served.connection_for(vol, HOST)
    assert served.connection_for(vol, HOST) == first
    served.resize_volume(vol, 32 * MiB)
    grown = served.refresh_connection(vol, HOST.name)
    assert isinstance(grown, NbdConnection) and isinstance(first, NbdConnection)
    assert grown.export != first.export
    _io(grown, "write -P 0x33 31M 1M")  # beyond the old size
    _io(first, "read 0 1M")  # the old export serves until retired
    served.retire_connections(vol, HOST.name)
    assert served.connection_for(vol, HOST) == grown
    served.remove_connection(vol, HOST.name)


@pytest.mark.integration
def test_a_missing_image_is_not_found_and_a_key_keeps_its_source(served: RbdBackend, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        served.connection_for(ids.new_id("volume"), HOST)
    vol = ids.new_id("volume")
    served.ensure_volume(vol, 16 * MiB)
    served.connection_for(vol, HOST)
    other = tmp_path / "f.raw"
    other.write_bytes(b"\0" * MiB)
    assert served.exports is not None
    with pytest.raises(IdempotentParameterMismatch):
        served.exports.ensure_export(vol, FileSource(other), HOST)
    served.remove_connection(vol, HOST.name)


@pytest.mark.integration
def test_the_cephx_key_is_on_no_argv_and_in_no_state_or_log_file(served: RbdBackend, ceph: CephForTests) -> None:
    vol = ids.new_id("volume")
    served.ensure_volume(vol, 16 * MiB)
    served.connection_for(vol, HOST)
    exports = served.exports
    assert isinstance(exports, NbdExportDriver) and exports.pid is not None
    key = ceph.admin_key()
    assert key.encode() not in Path(f"/proc/{exports.pid}/cmdline").read_bytes()
    assert key.encode() not in Path(f"/proc/{exports.pid}/environ").read_bytes()
    for f in exports.state_dir.rglob("*"):
        if f.is_file():
            assert key.encode() not in f.read_bytes(), f
    assert oct(exports.state_path.stat().st_mode & 0o777) == oct(0o600)
    assert oct(exports.state_dir.stat().st_mode & 0o777) == oct(0o700)
    served.remove_connection(vol, HOST.name)



# -- the iSCSI export of a real image (tgtd --bstype rbd) ---------------------------------------------


@pytest.fixture
def served_iscsi(ceph: CephForTests, tmp_path: Path) -> Iterator[tuple[RbdBackend, str]]:
    pool = ceph.new_pool()
    for make in drivers_of(tgtd_driver, tmp_path, "tgtd"):
        backend = RbdBackend("default", ceph.conf_path, rbd_pool=pool, exports=make())
        yield backend, pool
        backend.close()


@pytest.mark.integration
def test_a_volume_written_through_tgtds_rbd_store_is_in_its_image_and_grows_on_a_new_lun(
        served_iscsi: tuple[RbdBackend, str], ceph: CephForTests, tmp_path: Path) -> None:
    served, pool = served_iscsi
    vol = ids.new_id("volume")
    served.ensure_volume(vol, 16 * MiB)
    c = served.connection_for(vol, HOST)
    assert isinstance(c, IscsiConnection) and c.chap_secret is not None
    _io(c, "write -P 0x6b 3M 1M")
    # The bytes are in the image itself: read back by Ceph's own tool, not through tgtd.
    dump = tmp_path / "image.raw"
    subprocess.run(["rbd", "-c", str(ceph.conf_path), "export", f"{pool}/{vol}", str(dump)], check=True,
                   capture_output=True, timeout=120)
    data = dump.read_bytes()
    assert data[3 * MiB:4 * MiB] == b"\x6b" * MiB and data[:MiB] == b"\0" * MiB

    served.resize_volume(vol, 32 * MiB)
    grown = served.refresh_connection(vol, HOST.name)
    assert isinstance(grown, IscsiConnection) and grown.lun != c.lun and grown.iqn == c.iqn
    _io(grown, "write -P 0x2c 31M 1M")  # beyond the old size
    assert "Pattern verification failed" not in _io(grown, "read -P 0x6b 3M 1M")
    served.retire_connections(vol, HOST.name)
    served.remove_connection(vol, HOST.name)
    assert served.exports is not None and served.exports.list_exports() == []
    served.remove_volume(vol)  # tgtd closed the image: no watcher keeps it
    assert vol not in served.inventory().volumes
