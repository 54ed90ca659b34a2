"""iSCSI off loopback through a TLS tunnel (stunnel), from a second network namespace.

Real tgtd behind a real stunnel on a veth address; clients in another network namespace. Only the
attached host's certificate (the install's CA, its host name) gets through, and CHAP still
applies behind it, and the ACL holds the host's initiator name; a TCG guest's disk goes through
the host agent's own tunnel end. Every daemon is stopped by PID; the namespace and veth are
deleted at teardown.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import export_fixtures
from tests.conftest import wait_until
from tests.export_fixtures import MiB, drivers_of, guest_disk
from tests.test_iscsi_export import live_targets, tgtd_driver
from tests.test_nbd_access import Netns, netns  # noqa: F401 - the fixture
from vbs.config import host_initiator_name
from vbs.net.stunnel import client_config
from vbs.pools.exports import FileSource
from vbs.qemu.tls import X509Files
from vbs.storage.exports.iscsi import IscsiExportDriver
from vbs.system.argv import run
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import HostIdentity, IscsiConnection

pytestmark = pytest.mark.integration

VOL = "vol-0123456789abcdef0"
LOCAL_PORTS = {"hv-b": 13261, "foreign": 13262, "hv-a": 13263}  # client ends, inside the namespace
volume = export_fixtures.volume


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., IscsiExportDriver]]:
    yield from drivers_of(tgtd_driver, tmp_path, "tgtd")


@pytest.fixture
def tunnels_in_netns() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()  # by the PID we started
        p.wait(10)


class Site:
    def __init__(self, tmp: Path, ns: Netns) -> None:
        self.tmp, self.ns = tmp, ns
        self.ca = CertificateAuthority(tmp / "ca" / "ca.pem", tmp / "ca" / "ca-key.pem")
        node = self.ca.issue_in(tmp / "node", "storage-1", [ns.server])
        self.node = X509Files(node.cert, node.key, node.ca)

    def host_files(self, name: str, ca: CertificateAuthority | None = None) -> X509Files:
        issued = (ca or self.ca).issue_in(self.tmp / ("other-hosts" if ca else "hosts") / name, name, [name])
        return X509Files(issued.cert, issued.key, issued.ca)


def start_client_tunnel(site: Site, files: X509Files, port: int, procs: list[subprocess.Popen[bytes]],
                        name: str) -> int:
    """A host's tunnel end inside the namespace, on its own 127.0.0.1 port (returned)."""
    local = LOCAL_PORTS[name]
    conf = site.tmp / f"client-{name}.conf"
    conf.write_text(client_config(local, (site.ns.server, port), files))
    log = (site.tmp / f"client-{name}.log").open("wb")
    procs.append(subprocess.Popen(["ip", "netns", "exec", site.ns.name, "stunnel", str(conf)],
                                  stdout=log, stderr=subprocess.STDOUT))
    log.close()

    def listening() -> bool:
        table = run(["ip", "netns", "exec", site.ns.name, "cat", "/proc/net/tcp"], timeout=30).stdout
        return any(f.split()[3] == "0A" and int(f.split()[1].rsplit(":", 1)[1], 16) == local
                   for f in table.splitlines()[1:])

    wait_until(listening, 15, what=f"the {name} tunnel end")
    return local


def login(site: Site, c: IscsiConnection, *, via: int | None = None) -> tuple[bool, str]:
    """Log in and read the capacity from the namespace: to the portal, or ``via`` a tunnel end."""
    assert c.chap_secret is not None
    where = f"127.0.0.1:{via}" if via else f"{c.host}:{c.port}"
    url = f"iscsi://{c.chap_user}%{c.chap_secret.get_secret_value()}@{where}/{c.iqn}/{c.lun}"
    name = ["-i", c.initiator_name] if c.initiator_name else []  # as the host's QEMU logs in
    proc = run(["ip", "netns", "exec", site.ns.name, "iscsi-readcapacity16", *name, url], timeout=60, check=False)
    out = proc.stdout + proc.stderr
    return proc.returncode == 0 and f"Total size:{16 * MiB}" in out, out


def test_only_the_attached_hosts_certificate_gets_through_the_tunnel(
        make_driver: Callable[..., IscsiExportDriver], volume: Path, tmp_path: Path, netns: Netns,  # noqa: F811
        tunnels_in_netns: list[subprocess.Popen[bytes]]) -> None:
    site = Site(tmp_path, netns)
    drv = make_driver(listen_host=netns.server, tunnel=site.node)
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address=netns.client,
                                                                initiator_name=host_initiator_name("hv-a")))
    assert isinstance(c, IscsiConnection)
    assert (c.host, c.port, c.tls) == (netns.server, drv.port, "stunnel")
    assert drv.acl_by_name  # every login arrives from stunnel on 127.0.0.1: the ACL holds hv-a's name
    assert drv.portal == f"127.0.0.1:{drv.port}"  # tgtd itself only on loopback

    ok, out = login(site, c)  # plain iSCSI with the right CHAP, to the TLS port
    assert not ok, out

    b = start_client_tunnel(site, site.host_files("hv-b"), drv.port, tunnels_in_netns, "hv-b")
    ok, out = login(site, c, via=b)
    assert not ok, f"a CA certificate of a host with no export here got in: {out}"

    other = CertificateAuthority(tmp_path / "other" / "ca.pem", tmp_path / "other" / "ca-key.pem")
    # The right host name from another CA (the client itself trusts ours, so the server decides).
    forged = site.host_files("hv-a", other)
    forged = X509Files(forged.cert, forged.key, site.ca.ca_pem)
    foreign = start_client_tunnel(site, forged, drv.port, tunnels_in_netns, "foreign")
    ok, out = login(site, c, via=foreign)
    assert not ok, f"another CA's certificate got in: {out}"

    a = start_client_tunnel(site, site.host_files("hv-a"), drv.port, tunnels_in_netns, "hv-a")
    ok, out = login(site, c, via=a)
    assert ok, out
    assert c.chap_secret is not None
    wrong = c.model_copy(update={"chap_secret": type(c.chap_secret)("X" * 24)})
    ok, out = login(site, wrong, via=a)
    assert not ok and "Authentication failure" in out, out  # CHAP still applies behind the tunnel
    other_name = c.model_copy(update={"initiator_name": host_initiator_name("hv-b")})
    ok, out = login(site, other_name, via=a)
    assert not ok and "Target not found" in out, out  # and so does hv-a's initiator name

    server_log = (drv.state_dir / "stunnel.log").read_text()
    assert "Rejected by CERT at depth=0: CN=hv-a" in server_log  # the other CA's
    assert "Rejected by CERT at depth=0: CN=hv-b" in server_log  # a host with no export here
    assert drv.tunnel_pid is not None
    environ = Path(f"/proc/{drv.tunnel_pid}/environ").read_bytes()
    assert {i.split(b"=", 1)[0] for i in environ.split(b"\0") if i} <= {b"PATH", b"LC_ALL"}

    drv.remove_export(VOL, "hv-a")
    again = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-c", address=netns.client))
    assert isinstance(again, IscsiConnection)
    # hv-a holds no export any more: its certificate no longer gets through (stunnel reloads its
    # config on SIGHUP, so wait for the reload rather than for a fixed time).
    wait_until(lambda: not login(site, again, via=a)[0], 30, what="hv-a shut out of the tunnel")


def test_a_guest_disk_through_the_host_agents_tunnel_end(
        make_driver: Callable[..., IscsiExportDriver], volume: Path, tmp_path: Path, netns: Netns) -> None:  # noqa: F811
    site = Site(tmp_path, netns)
    drv = make_driver(listen_host=netns.server, tunnel=site.node)
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address=netns.server,
                                                                initiator_name=host_initiator_name("hv-a")))
    assert isinstance(c, IscsiConnection) and c.tls == "stunnel"
    assert live_targets(drv)[c.iqn].acl == {host_initiator_name("hv-a")}  # QEMU logs in with it
    with guest_disk(tmp_path, VOL, c, volume, site.host_files("hv-a"), "over-stunnel") as disk:
        (pid,) = disk.qemu.tunnels.pids()
        assert b"stunnel" in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert disk.qemu.attach("vm1", disk.serial, c).serial == disk.serial  # idempotent, same tunnel
        assert disk.qemu.tunnels.pids() == [pid]
