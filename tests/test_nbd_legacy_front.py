"""Exports made before the nbd driver's fronts (release 0.1.0: qemu-storage-daemon listened on TCP
``nbd_port`` itself; its state file has exports with no address and no port) ride out the upgrade:
their hosts' QEMU reconnects to ``nbd_port``, where the *legacy front* answers to those exports' names
only. Real qemu-storage-daemon, nbdkit, qemu-io and nbdinfo on loopback; every daemon stopped by PID.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import export_fixtures
from tests.conftest import free_ports
from tests.export_fixtures import MiB, drivers_of, read_at, wait_dead
from tests.test_nbd_access import attempt, client_dir, psk_client, qemu_io, tcp
from vbs.pools.exports import FileSource
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import HostIdentity, NbdConnection

pytestmark = pytest.mark.integration

VOL, VOL2, VOL3 = "vol-0123456789abcdef0", "vol-0123456789abcdef1", "vol-0123456789abcdef2"
volume = export_fixtures.volume


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, "qemu-storage-daemon")


def old_item(key: str, path: Path, host: str) -> tuple[dict[str, Any], str]:
    """One key as 0.1.0's driver wrote it into ``exports.json`` (state.py and driver.py of f439ad9: one
    chain, one export with no address and no port), and the export's name."""
    h = hashlib.sha256(f"{key}/0".encode()).hexdigest()[:24]
    name = f"{key}-{secrets.token_hex(16)}"
    return {
        "key": key, "path": str(path), "format": "raw", "rbd": None,
        "chains": [{"gen": 0, "read_only": False, "size": 16 * MiB, "file_node": f"vbsf{h}", "raw_node": f"vbsr{h}",
                    "throttle_node": f"vbsq{h}", "fair_node": None, "fair_group": None}],
        "exports": [{"host": host, "gen": 0, "read_only": False, "name": name, "id": f"vbs_{key}_{host}_0"}],
        "copies": [], "views": [], "limits": None,
    }, name


def test_exports_made_before_the_fronts_keep_nbd_port_through_the_legacy_front(
        make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    node = ca.issue_in(tmp_path / "node", "storage-1", ["127.0.0.1"])
    x509 = X509Files(node.cert, node.key, node.ca)
    port = free_ports(4)
    vol2 = tmp_path / "vol2.img"
    vol2.write_bytes(bytes(16 * MiB))
    (tmp_path / "state").mkdir(mode=0o700)
    a, name_a = old_item(VOL, volume, "hv-a")
    b, name_b = old_item(VOL2, vol2, "hv-b")
    (tmp_path / "state" / "exports.json").write_text(json.dumps({"version": 2, "items": [a, b]}))

    drv = make_driver(port=port, listen_host="127.0.0.1", tls="x509", x509=x509)
    drv.start()
    legacy = drv.front_pid(VOL, "hv-a")
    assert legacy is not None and drv.front_pid(VOL2, "hv-b") == legacy  # one front for both
    # The attach retry (or the controller's reconcile) gets the connection the host has: nbd_port, the name.
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address="127.0.0.1"))
    assert isinstance(c, NbdConnection)
    assert (c.host, c.port, c.export, c.tls) == ("127.0.0.1", port, name_a, "x509")
    assert drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address="127.0.0.1")) == c

    # Any certificate of the install's CA that knows a legacy name opens it; none of another CA does.
    host_a = client_dir(ca, tmp_path, "hv-a", ["10.9.9.9"])  # the address 0.1.0 never recorded
    other_ca = CertificateAuthority(tmp_path / "other" / "ca.pem", tmp_path / "other" / "ca-key.pem")
    issued = other_ca.issue_in(tmp_path / "other" / "issued", "hv-a", ["127.0.0.1"])
    # It trusts this node (the install's CA) but shows a certificate of another CA: the front refuses it.
    foreign = qemu_x509_dir(X509Files(issued.cert, issued.key, node.ca), tmp_path / "other" / "client", "client")
    ok, out = attempt(qemu_io(tcp(c), "write -P 0x5a 0 64k", tls_dir=host_a))
    assert ok, out
    assert read_at(volume, 0, 64 * 1024) == b"\x5a" * 64 * 1024
    ok, out = attempt(["nbdinfo", f"nbds://127.0.0.1:{port}/{name_a}?tls-certificates={foreign}"])
    assert not ok and "tls" in out.lower(), out  # refused in the handshake (libnbd shows it, unlike qemu-io)
    ok, out = attempt(qemu_io(tcp(c), "read 0 4k"))
    assert not ok, out

    # A new export gets a front of its own on another port; the legacy front refuses its name and lists none.
    vol3 = tmp_path / "vol3.img"
    vol3.write_bytes(bytes(16 * MiB))
    new = drv.ensure_export(VOL3, FileSource(vol3), HostIdentity(name="hv-c", address="127.0.0.1"))
    assert isinstance(new, NbdConnection) and new.port not in (None, port)
    host_c = client_dir(ca, tmp_path, "hv-c", ["127.0.0.1"])
    ok, out = attempt(qemu_io(tcp(c, export=new.export), "read 0 4k", tls_dir=host_c))
    assert not ok and "export" in out.lower(), out
    listed, out = attempt(["nbdinfo", "--list", "--json", f"nbds://127.0.0.1:{port}/?tls-certificates={host_c}"])
    assert listed and VOL not in out and VOL2 not in out and VOL3 not in out, out
    ok, out = attempt(qemu_io(tcp(new), "write -P 0x33 0 4k", tls_dir=host_c))
    assert ok, out

    # A restarted agent adopts it; one that died is started again by check().
    drv.close()
    drv = make_driver(port=port, listen_host="127.0.0.1", tls="x509", x509=x509)
    drv.start()
    assert drv.front_pid(VOL, "hv-a") == legacy
    os.kill(legacy, signal.SIGKILL)
    wait_dead(legacy)
    drv.check()
    again = drv.front_pid(VOL, "hv-a")
    assert again is not None and again != legacy
    ok, out = attempt(qemu_io(tcp(c), "read -P 0x5a 0 64k", tls_dir=host_a))
    assert ok, out

    # An online resize of a legacy export: its successor is on the legacy front too (the host's QEMU
    # knows that port), and the older name goes as it is retired.
    with open(vol2, "r+b") as f:
        f.truncate(32 * MiB)
    host_b = client_dir(ca, tmp_path, "hv-b", ["127.0.0.1"])
    grown = drv.refresh_export(VOL2, FileSource(vol2), "hv-b")
    assert isinstance(grown, NbdConnection) and (grown.port, grown.tls) == (port, "x509") and grown.export != name_b
    ok, out = attempt(qemu_io(tcp(grown), "write -P 0x44 20M 4k", tls_dir=host_b))
    assert ok, out
    drv.retire_exports(VOL2, "hv-b")
    ok, out = attempt(qemu_io(tcp(c, export=name_b), "read 0 4k", tls_dir=host_b))
    assert not ok and "export" in out.lower(), out
    before = drv.front_pid(VOL, "hv-a")
    assert before is not None

    # hv-b's export goes: the front serves hv-a's name alone from then on.
    drv.remove_export(VOL2, "hv-b")
    wait_dead(before)
    smaller = drv.front_pid(VOL, "hv-a")
    assert smaller is not None and smaller != before
    ok, out = attempt(qemu_io(tcp(grown), "read 0 4k", tls_dir=host_b))
    assert not ok and "export" in out.lower(), out
    ok, out = attempt(qemu_io(tcp(c), "read -P 0x5a 0 64k", tls_dir=host_a))
    assert ok, out

    # With the last one, the legacy front stops; nbd_port refuses connections.
    drv.remove_export(VOL, "hv-a")
    wait_dead(smaller)
    listed, out = attempt(["nbdinfo", "--list", f"nbds://127.0.0.1:{port}/?tls-certificates={host_a}"])
    assert not listed and "refused" in out.lower(), out
    fronts = tmp_path / "state" / "fronts"
    assert not list((fronts / "run").glob("legacy-*.pid")) and not list((fronts / "tls").glob("legacy-*"))
    ok, out = attempt(qemu_io(tcp(new), "read -P 0x33 0 4k", tls_dir=host_c))
    assert ok, out  # the new export's own front: untouched


def test_with_tls_psk_the_legacy_front_takes_the_keys_of_the_hosts_that_hold_its_exports(
        make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path) -> None:
    port = free_ports(4)
    (tmp_path / "state" / "tls").mkdir(mode=0o700, parents=True)
    a, name_a = old_item(VOL, volume, "hv-a")
    (tmp_path / "state" / "exports.json").write_text(json.dumps({"version": 2, "items": [a]}))
    key_a = secrets.token_hex(32)
    (tmp_path / "state" / "tls" / "keys.psk").write_text(f"hv-a:{key_a}\n")  # 0.1.0's one key file
    drv = make_driver(port=port, listen_host="127.0.0.1", tls="psk")
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address="127.0.0.1"))
    assert isinstance(c, NbdConnection) and c.tls_psk_key is not None
    assert (c.port, c.export, c.tls, c.tls_psk_identity, c.tls_psk_key.get_secret_value()) == (
        port, name_a, "psk", "hv-a", key_a)  # what hv-a's QEMU holds since 0.1.0
    ok, out = attempt(psk_client(tmp_path, c, "hv-a", key_a, "write -P 0x61 0 4k"))
    assert ok, out
    assert read_at(volume, 0, 4096) == b"\x61" * 4096

    vol3 = tmp_path / "vol3.img"
    vol3.write_bytes(bytes(16 * MiB))
    new = drv.ensure_export(VOL3, FileSource(vol3), HostIdentity(name="hv-c", address="127.0.0.1"))
    assert isinstance(new, NbdConnection) and new.tls_psk_key is not None and new.port not in (None, port)
    key_c = new.tls_psk_key.get_secret_value()
    for argv in (psk_client(tmp_path, c, "hv-c", key_c, "read 0 4k"),  # a key the legacy front does not hold
                 psk_client(tmp_path, c, "hv-a", key_a, "read 0 4k", new.export)):  # a name it does not answer to
        ok, out = attempt(argv)
        assert not ok, out
    ok, out = attempt(psk_client(tmp_path, new, "hv-c", key_c, "read 0 4k"))
    assert ok, out

    legacy = drv.front_pid(VOL, "hv-a")
    assert legacy is not None
    drv.remove_export(VOL, "hv-a")
    wait_dead(legacy)
    ok, out = attempt(psk_client(tmp_path, c, "hv-a", key_a, "read 0 4k"))
    assert not ok and "refused" in out.lower(), out
