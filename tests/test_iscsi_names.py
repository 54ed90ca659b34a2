"""iSCSI initiator names in the ACL: where tgtd is reached on loopback (``vbs up``, or behind the TLS
tunnel) every host logs in from 127.0.0.1, so the ACL holds the attached host's initiator name and
a login needs that name AND its CHAP secret. Plain TCP off loopback keeps the address, because
tgt admits a login whose address OR whose name is bound (measured below).

Real tgtd, libiscsi's tools with ``-i IQN``, qemu-io; one tgtd per test on a free port, stopped
by PID; the namespace test deletes its namespace and veth at teardown.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import export_fixtures
from tests.export_fixtures import MiB, drivers_of, wait_dead
from tests.test_iscsi_export import Make, iscsi_url, live_targets, logged_in, qemu_io, readcap, tgtadm, tgtd_driver
from tests.test_nbd_access import Netns, netns  # noqa: F401 - the fixture
from vbs.config import HostAgentConfig, host_initiator_name
from vbs.pools.exports import FileSource
from vbs.storage.exports.iscsi import IscsiExportDriver
from vbs.system.argv import run
from vbs.wire.connection import HostIdentity, IscsiConnection

pytestmark = pytest.mark.integration

VOL = "vol-0123456789abcdef0"
NAME_A = host_initiator_name("hv-a")
NAME_B = host_initiator_name("hv-b")
HOST_A = HostIdentity(name="hv-a", address="127.0.0.1", initiator_name=NAME_A)
volume = export_fixtures.volume


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Make]:
    yield from drivers_of(tgtd_driver, tmp_path, "tgtd")


def export(drv: IscsiExportDriver, volume: Path, host: HostIdentity = HOST_A) -> IscsiConnection:
    c = drv.ensure_export(VOL, FileSource(volume), host)
    assert isinstance(c, IscsiConnection)
    return c


def refused(c: IscsiConnection, why: str, **kw: str) -> bool:
    rc, out = readcap(c, **kw)
    assert rc != 0 and why in out, out
    return True


def test_each_host_gets_an_initiator_name_of_its_own() -> None:
    assert HostAgentConfig(node_name="hv-a").initiator_name == NAME_A == "iqn.2026-11.org.vbs.host:hv-a"
    assert HostAgentConfig(node_name="hv-b").initiator_name == NAME_B
    given = "iqn.1994-05.com.redhat:abc"
    assert HostAgentConfig(node_name="hv-a", initiator_name=given).initiator_name == given
    for bad in ("iqn.2026-11.org.vbs:a b", "iqn.2026-11.org.vbs:x\n", "eui.0123", ""):
        with pytest.raises(ValueError):
            HostAgentConfig(initiator_name=bad)


def test_tgt_admits_a_bound_name_from_any_address(make_driver: Make, volume: Path) -> None:
    """Why names are never bound beside addresses: tgt ORs the two kinds of ACL entry."""
    drv = make_driver()
    far = HostIdentity(name="hv-far", address="127.0.0.2")  # no name: the address rule
    c = export(drv, volume, far)
    assert live_targets(drv)[c.iqn].acl == {"127.0.0.2"}
    assert refused(c, "Target not found", initiator=NAME_A)  # every client here is 127.0.0.1
    tid = str(live_targets(drv)[c.iqn].tid)
    tgtadm(drv, "--mode", "target", "--op", "bind", "--tid", tid, "--initiator-name", NAME_A)
    assert logged_in(c, initiator=NAME_A)  # 127.0.0.1 is not bound, yet the name gets in
    assert refused(c, "Target not found", initiator=NAME_B)
    drv.check()  # the reconcile takes the hand-bound name away again
    assert live_targets(drv)[c.iqn].acl == {"127.0.0.2"}
    assert refused(c, "Target not found", initiator=NAME_A)


def test_on_loopback_a_login_needs_the_hosts_name_and_its_chap_secret(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    assert drv.acl_by_name
    c = export(drv, volume)
    assert c.initiator_name == NAME_A  # what the hypervisor logs in with
    assert live_targets(drv)[c.iqn].acl == {NAME_A}  # the name alone: 127.0.0.1 would admit anyone here
    assert logged_in(c, initiator=NAME_A)
    assert refused(c, "Target not found", initiator=NAME_B)  # another host's name, the right secret
    assert refused(c, "Target not found")  # libiscsi's own default name
    right = c.chap_secret.get_secret_value() if c.chap_secret else ""
    assert refused(c, "Authentication failure", initiator=NAME_A, user="", secret="")  # no CHAP
    assert refused(c, "Authentication failure", initiator=NAME_A, secret=("Y" if right[0] == "X" else "X") + right[1:])
    rc, out = qemu_io(c, "write -P 0x5a 0 4k")  # QEMU's initiator, given the name as the host agent gives it
    assert rc == 0, out
    rc, out = qemu_io(c, "read -P 0x5a 0 4k")
    assert rc == 0, out
    rc, out = qemu_io(c.model_copy(update={"initiator_name": NAME_B}), "read 0 4k")
    assert rc != 0, out


def test_each_host_of_a_multi_attached_volume_is_bound_by_name(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    a = export(drv, volume)
    b = export(drv, volume, HostIdentity(name="hv-b", address="127.0.0.1", initiator_name=NAME_B))
    assert live_targets(drv)[a.iqn].acl == {NAME_A, NAME_B}
    assert logged_in(a, initiator=NAME_A) and logged_in(b, initiator=NAME_B)
    drv.remove_export(VOL, "hv-b")
    assert live_targets(drv)[a.iqn].acl == {NAME_A}
    assert refused(b, "Target not found", initiator=NAME_B) and logged_in(a, initiator=NAME_A)


def test_a_host_that_sends_no_name_keeps_the_address_rule(make_driver: Make, volume: Path) -> None:
    """An agent of 0.1.0 reports no initiator name: its grant stays on its address."""
    drv = make_driver()
    c = export(drv, volume, HostIdentity(name="hv-old", address="127.0.0.1"))
    assert c.initiator_name is None and live_targets(drv)[c.iqn].acl == {"127.0.0.1"}
    assert logged_in(c)
    # The same host upgraded, its disk still attached: the grant keeps what its hypervisor was
    # given (a reconnect logs in with the old default name); the name comes with the next grant.
    upgraded = HostIdentity(name="hv-old", address="127.0.0.1", initiator_name=NAME_B)
    assert export(drv, volume, upgraded) == c and live_targets(drv)[c.iqn].acl == {"127.0.0.1"}
    drv.remove_export(VOL, "hv-old")
    c2 = export(drv, volume, upgraded)
    assert c2.initiator_name == NAME_B and live_targets(drv)[c.iqn].acl == {NAME_B}
    assert logged_in(c2, initiator=NAME_B) and refused(c2, "Target not found", initiator=NAME_A)


def test_the_name_binding_survives_agent_restarts_and_a_killed_tgtd(make_driver: Make, volume: Path) -> None:
    first = make_driver()
    c = export(first, volume)
    pid = first.pid
    first.close()  # the agent goes away, tgtd keeps serving
    # What an agent of 0.1.0 left in tgtd for the same grant: the address, not the name.
    tid = str(live_targets(first)[c.iqn].tid)
    tgtadm(first, "--mode", "target", "--op", "unbind", "--tid", tid, "--initiator-name", NAME_A)
    tgtadm(first, "--mode", "target", "--op", "bind", "--tid", tid, "--initiator-address", "127.0.0.1")
    second = make_driver(port=first.port, control_port=first.control_port)
    second.start()  # adopts tgtd and reconciles it with the desired-state file
    assert pid is not None and second.pid == pid and live_targets(second)[c.iqn].acl == {NAME_A}
    assert logged_in(c, initiator=NAME_A) and refused(c, "Target not found", initiator=NAME_B)
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    second.check()  # a new tgtd, the same targets, accounts and names
    assert second.pid not in (None, pid) and live_targets(second)[c.iqn].acl == {NAME_A}
    assert logged_in(c, initiator=NAME_A) and refused(c, "Target not found", initiator=NAME_B)


def test_plain_tcp_off_loopback_binds_the_address_only(make_driver: Make, volume: Path, netns: Netns) -> None:  # noqa: F811
    """``--insecure`` on a network: the address means something, and a name beside it would admit
    that name from anywhere (test_tgt_admits_a_bound_name_from_any_address)."""
    drv = make_driver(listen_host=netns.server)
    assert not drv.acl_by_name
    c = export(drv, volume, HostIdentity(name="hv-a", address=netns.client, initiator_name=NAME_A))
    assert c.initiator_name == NAME_A and live_targets(drv)[c.iqn].acl == {netns.client}
    inside = run(["ip", "netns", "exec", netns.name, "iscsi-readcapacity16", "-i", NAME_A, iscsi_url(c)],
                 timeout=60, check=False)
    assert inside.returncode == 0 and f"Total size:{16 * MiB}" in inside.stdout, inside.stdout + inside.stderr
    assert refused(c, "Target not found", initiator=NAME_A)  # the right name from another address
