"""A storage node pulls a volume from another node's NBD export (``FileBackend.pull_volume``): a real
export daemon (qemu-storage-daemon) serving over TLS, a real ``qemu-img`` pulling. The export's ACL
names the pulling *node*: with X.509 only the certificate whose CN is that node's name gets in, with
TLS-PSK only the key its connection carries; the data arrives whole, sparse where it was."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.export_fixtures import drivers_of
from vbs.pools.exports import FileSource
from vbs.qemu.tls import X509Files
from vbs.storage.backends.file import FileBackend
from vbs.storage.exports.nbd import QSD, NbdExportDriver
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.storage import ItemStatus

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
VOL = "vol-0123456789abcdef0"
SIZE = 64 * MIB


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, QSD)


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "old" / f"{VOL}.raw"
    path.parent.mkdir()
    data = os.urandom(4 * MIB)
    with path.open("wb") as f:
        f.truncate(SIZE)
        f.seek(40 * MIB)
        f.write(data)
    return path, data


def pool(tmp_path: Path, name: str, x509: X509Files | None = None) -> FileBackend:
    (tmp_path / name).mkdir()
    return FileBackend(name, tmp_path / name, clone_method="copy", x509=x509)


def pulled(backend: FileBackend, conn: NbdConnection, timeout: float = 60) -> ItemStatus:
    deadline = time.monotonic() + timeout
    while (status := backend.pull_volume(VOL, SIZE, conn)).state == "copying":
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    return status


def test_a_node_pulls_over_x509_with_its_own_certificate_and_only_that_node_gets_in(
        make_driver: Callable[..., NbdExportDriver], source: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = source
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    old = ca.issue_in(tmp_path / "old-node", "storage-1", ["127.0.0.1"])
    drv = make_driver(listen_host="127.0.0.1", tls="x509", x509=X509Files(old.cert, old.key, old.ca))
    drv.start()
    conn = drv.ensure_export(VOL, FileSource(path), HostIdentity(name="storage-2", address="127.0.0.1"),
                             read_only=True)
    assert isinstance(conn, NbdConnection) and conn.tls == "x509"

    other = ca.issue_in(tmp_path / "other-node", "storage-3", ["127.0.0.1"])
    intruder = pool(tmp_path, "intruder", X509Files(other.cert, other.key, other.ca))
    refused = pulled(intruder, conn)
    assert refused.state == "error" and "qemu-img" in (refused.error or ""), refused
    assert not (tmp_path / "intruder" / "volumes" / f"{VOL}.raw").exists()

    new = ca.issue_in(tmp_path / "new-node", "storage-2", ["127.0.0.1"])
    target = pool(tmp_path, "target", X509Files(new.cert, new.key, new.ca))
    assert pulled(target, conn).state == "ready"
    copy = tmp_path / "target" / "volumes" / f"{VOL}.raw"
    assert copy.read_bytes() == path.read_bytes()
    assert os.stat(copy).st_blocks * 512 < 16 * MIB, "the holes stay holes"
    # Repeated (a controller that restarted): ready, nothing copied again.
    assert target.pull_volume(VOL, SIZE, conn).state == "ready"


def psk_export_to_storage_2(make_driver: Callable[..., NbdExportDriver], path: Path) -> Any:
    """The old node's read-only TLS-PSK export of VOL to the node ``storage-2``."""
    drv = make_driver(listen_host="127.0.0.1", tls="psk")
    drv.start()
    return drv.ensure_export(VOL, FileSource(path), HostIdentity(name="storage-2", address="127.0.0.1"),
                             read_only=True)


def test_a_node_pulls_over_tls_psk_with_the_key_its_connection_carries(
        make_driver: Callable[..., NbdExportDriver], source: tuple[Path, bytes], tmp_path: Path) -> None:
    path, _data = source
    conn = psk_export_to_storage_2(make_driver, path)
    assert isinstance(conn, NbdConnection) and conn.tls == "psk"
    target = pool(tmp_path, "target")
    assert pulled(target, conn).state == "ready"
    assert (tmp_path / "target" / "volumes" / f"{VOL}.raw").read_bytes() == path.read_bytes()
    assert not any((tmp_path / "target" / ".vbs-pull").rglob("keys.psk")), "the key file lives while the copy runs"


def test_a_pull_removed_midway_stops_and_leaves_nothing(
        make_driver: Callable[..., NbdExportDriver], source: tuple[Path, bytes], tmp_path: Path) -> None:
    path, _data = source
    conn = psk_export_to_storage_2(make_driver, path)
    assert isinstance(conn, NbdConnection)
    target = pool(tmp_path, "target")
    target.pull_volume(VOL, SIZE, conn)
    target.remove_volume(VOL)
    assert target.volume_status(VOL).state == "absent"
    assert list((tmp_path / "target" / "volumes").iterdir()) == []
