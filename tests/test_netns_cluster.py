"""VBS installed on machines that are network namespaces, by docs/install.md's own commands (tests/install_guide.py
runs them; the guide's "Trying it in network namespaces" says what differs): PostgreSQL (TLS), two
controllers, a storage node (file pool, NBD with TLS), a hypervisor node with the test guest, and a client
machine for the CLI, each in its own namespace with its own address on a bridge (src/vbs/rigs/netns.py),
over the wheel (tests/installed.py), TLS everywhere with certificates of the install's CA for those
addresses.

A second hypervisor node (hv-2, with vm2) joins as the guide's further nodes do. Through it all, from the
client machine's CLI and checked inside the guests: a volume written on hv-1 is read on hv-2; a volume
is attached across the bridge over NBD, written, snapshotted, cloned from the snapshot, read back,
detached and deleted; then the first controller is killed and the second one carries a create and an
attach. boto3 on the client machine drives the EC2 API over TLS.

An iSCSI storage node (stor-2, section 7 with EXPORT=iscsi) joins last: a guest writes one of its volumes
through its TLS tunnel, and only the certificate of the host holding the export reaches its tgtd; vm1 then
live-migrates to hv-2 with a volume of each storage node, and the iSCSI one moves to stor-1 under it.

A Ceph cluster in a namespace of its own (ceph-1, its daemons bound to its address) and an RBD storage
node on it (stor-3) join by the guide's "A Ceph RBD storage node": each hypervisor's QEMU opens a volume
there itself (librbd straight to ceph-1), vm1 writes it, it is snapshotted, and vm2 on hv-2 reads it back.
Every process is stopped by its PID and every namespace is gone at the end (the rig fails the teardown
if a process was left in one).

The controllers run as the guide's unprivileged user ``vbs`` (their unit's ``User=vbs``): its ``useradd``,
``runuser -u vbs --``, ``install -d -o vbs -g vbs``, ``chown``, ``chgrp`` and ``chmod`` lines run as
written. The namespaces share the host's /etc/passwd, so the ``useradd`` line runs once, on ctl-1, where
the host has no user ``vbs`` yet (the user is removed at the end); ctl-2's ``useradd`` is satisfied by
that user and counted as run. A host that has a user ``vbs`` of its own lends it to both and keeps it.
"""

from __future__ import annotations

import json
import pwd
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from cryptography import x509

from tests.conftest import wait_until
from tests.install_guide import CLUSTER_NET, OWNERSHIP, section, vbs_lines
from tests.installed import Installed
from tests.netns_install import HOST_DIR, NetnsInstall, connect, iscsi_login, netns_cluster
from vbs.rigs.testguest import pattern_sha256

pytestmark = pytest.mark.integration

# Sections of the guide run here, in order: all but the packages, the wheelhouse (tests/installed.py
# builds it), PostgreSQL's packaged cluster (its equivalent below), the units' notes and the upgrades.
RUN = ("3.", "5.", "Credentials and certificates", "6.", "7.", "A Ceph RBD", "8.", "9.")


@pytest.fixture(scope="module")
def netns_install(installed: Installed) -> Iterator[NetnsInstall]:
    with netns_cluster(installed, ceph=True) as done:
        yield done


def test_the_guide_s_commands_install_a_cluster_of_namespaces(netns_install: NetnsInstall) -> None:
    """Every vbs line of the sections run was run; every service is up, apart, on its own address."""
    expected = [line for title in RUN for line in vbs_lines(section(title))]
    ran = netns_install.runner.ran
    # Section 3 on each of 4 machines, the credentials' per-node lines for stor-1 and hv-1.
    node_lines = vbs_lines(section("Credentials and certificates")[1:])
    assert len(node_lines) == 2
    assert sorted(ran) == sorted(expected + vbs_lines(section("3.")) * 3 + node_lines)
    # The user's and the ownership's lines ran too, each of them (useradd on both controller machines).
    owning = [line for title in RUN for block in section(title) for line in block.splitlines() if OWNERSHIP.match(line)]
    assert {line.split()[0] for line in owning} == {"useradd", "install", "chown", "chgrp", "chmod"}
    assert set(owning) <= set(netns_install.runner.done)
    assert len([line for line in netns_install.runner.done if line.startswith("useradd ")]) == 2
    nodes = netns_install.cli("describe-storage-nodes")["storage_nodes"]
    (stor,) = [n for n in nodes if n["name"] == "stor-1"]
    assert stor["url"] == f"https://{CLUSTER_NET}20:8771", stor
    (hv,) = [h for h in netns_install.cli("describe-hosts")["hosts"] if h["name"] == "hv-1"]
    assert hv["url"] == f"https://{CLUSTER_NET}30:8772", hv
    controllers = netns_install.cli("describe-controllers")["controllers"]
    assert sorted(c["state"] for c in controllers) == ["up", "up"], controllers


def uids(pid: int) -> list[int]:
    """The real, effective, saved and file-system uids of process ``pid``."""
    (line,) = [line for line in open(f"/proc/{pid}/status").read().splitlines() if line.startswith("Uid:")]
    return [int(u) for u in line.split()[1:]]


def test_the_controllers_run_as_the_user_vbs_and_the_agents_as_root(netns_install: NetnsInstall) -> None:
    """As their units say (User=vbs for the controller, none for the agents): every uid of each controller's
    process is vbs's, and it serves (both are up); its data dir is the guide's, 0700 and vbs's."""
    vbs = pwd.getpwnam("vbs").pw_uid
    assert vbs == netns_install.runner.user.uid() != 0
    services = netns_install.runner.services
    assert set(services) >= {"ctl-1", "ctl-2", "stor-1", "stor-2", "hv-1", "hv-2"}
    for name, proc in services.items():
        assert proc.poll() is None, name
        assert uids(proc.pid) == [vbs if name.startswith("ctl-") else 0] * 4, name
    for name in ("ctl-1", "ctl-2"):
        data = netns_install.machines[name].path("/var/lib/vbs/controller").stat()
        assert (data.st_uid, data.st_gid, data.st_mode & 0o777) == (vbs, pwd.getpwnam("vbs").pw_gid, 0o700), name
    controllers = netns_install.cli("describe-controllers")["controllers"]
    assert sorted((c["controller_id"], c["state"]) for c in controllers) == [("ctl-1", "up"), ("ctl-2", "up")]


def test_the_services_are_apart_and_their_certificates_name_their_addresses(netns_install: NetnsInstall) -> None:
    m = netns_install.machines
    assert connect(netns_install, "hv-1", m["stor-1"].machine.address, 8771) == "open"
    # The storage agent serves on its address only, and hv-1's loopback is its own.
    assert connect(netns_install, "hv-1", "127.0.0.1", 8771) == "ConnectionRefusedError"
    assert connect(netns_install, "stor-1", "127.0.0.1", 8771) == "ConnectionRefusedError"
    assert connect(netns_install, "client", m["db"].machine.address, 5432) == "open"
    for name, path in (("ctl-1", "/var/lib/vbs/controller/tls/ctl-1.pem"),
                       ("ctl-2", "/var/lib/vbs/controller/tls/ctl-2.pem"),
                       ("stor-1", "/etc/vbs/tls/stor-1.pem"), ("hv-1", "/etc/vbs/tls/hv-1.pem"),
                       ("hv-2", "/etc/vbs/tls/hv-2.pem")):
        cert = x509.load_pem_x509_certificate(m[name].path(path).read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == [m[name].machine.address], name
    # Each service's process is in its machine's namespace.
    for name, proc in netns_install.runner.services.items():
        assert proc.poll() is None and proc.pid in netns_install.cluster.pids(m[name].machine.netns), name


# boto3 on the client machine: the EC2 API of the second controller over TLS (the install's CA), its key from
# the client's copy of the credentials file (a path in the environment, the key itself in neither argv nor env).
BOTO3 = """
import sys, boto3
ec2 = boto3.client("ec2", endpoint_url=sys.argv[1], region_name="us-east-1")
made = ec2.create_volume(Size=1, AvailabilityZone="us-east-1a")["VolumeId"]
ec2.get_waiter("volume_available").wait(VolumeIds=[made], WaiterConfig={"Delay": 1, "MaxAttempts": 300})
(found,) = ec2.describe_volumes(VolumeIds=[made])["Volumes"]
ec2.delete_volume(VolumeId=made)
print(made, found["State"], found["Size"])
"""


def test_boto3_on_the_client_machine_drives_the_ec2_api_over_tls(netns_install: NetnsInstall) -> None:
    c = netns_install
    client = c.machines["client"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(client.path("/root/")),
           "AWS_SHARED_CREDENTIALS_FILE": str(client.path("/var/lib/vbs/controller/credentials")),
           "AWS_CA_BUNDLE": str(client.path("/var/lib/vbs/controller/ca.pem")), "AWS_PROFILE": "default"}
    endpoint = f"https://{c.machines['ctl-2'].machine.address}:8770"
    proc = c.cluster.run(client.machine, [sys.executable, "-c", BOTO3, endpoint], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    made, state, size = proc.stdout.split()
    assert (state, size) == ("available", "1")
    (gone,) = c.cli("describe-volumes", made)["volumes"]
    assert gone["status"] in ("deleting", "deleted")


def test_a_volume_written_on_one_hypervisor_node_is_read_on_the_other(netns_install: NetnsInstall) -> None:
    c = netns_install
    vol = c.create("stor-1")
    c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--wait")
    c.write(vol, "moved", 4, "hv-1")
    c.detach(vol, "hv-1")
    c.cli("attach-volume", vol, "--host", "hv-2", "--vm", "vm2", "--wait")
    assert c.checksum(vol, 4, "hv-2") == pattern_sha256("moved", 4)
    c.detach(vol, "hv-2")
    c.cli("delete-volume", vol, "--wait")


def peers(c: NetnsInstall, machine: str, selector: str) -> set[str]:
    """The remote addresses of ``machine``'s established TCP connections that ``ss``'s ``selector`` picks."""
    proc = c.cluster.run(c.machines[machine].machine, ["ss", "-Htn", "state", "established", selector],
                         env={"PATH": "/usr/sbin:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return {line.split()[-1].rsplit(":", 1)[0] for line in proc.stdout.splitlines() if line.strip()}


def cephx_users(c: NetnsInstall) -> set[str]:
    assert c.ceph is not None
    return {e["entity"] for e in json.loads(c.ceph.ceph("auth", "ls", "--format", "json"))["auth_dump"]}


def test_an_rbd_volume_reaches_a_guest_on_each_hypervisor_node_natively(netns_install: NetnsInstall) -> None:
    """stor-3 keeps its volumes in the Ceph of ceph-1 (its own namespace and address): a volume made there is
    opened by each hypervisor's QEMU itself (librbd, connected to ceph-1's monitor and OSD: no export on
    stor-3), as the cephx user of that one attachment. vm1 on hv-1 writes it, a snapshot is taken, it moves
    to vm2 on hv-2, which reads it back bit-exact, and a volume made from the snapshot holds the same."""
    c = netns_install
    ceph_1 = c.machines["ceph-1"].machine.address
    (node,) = [n for n in c.cli("describe-storage-nodes")["storage_nodes"] if n["name"] == "stor-3"]
    assert node["url"] == f"https://{CLUSTER_NET}22:8771", node
    vol = c.create("stor-3")
    with c.timed("attach over native rbd to a guest across the bridge (a cephx user made)"):
        c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--wait")
        c.guest_disk(vol, "hv-1")
    assert f"client.vbs.hv-1.{vol}" in cephx_users(c)
    assert ceph_1 in peers(c, "hv-1", f"( dst {ceph_1} )")  # QEMU's librbd, to the monitor and the OSD
    seed = f"rbd{int(time.time())}"
    c.write(vol, seed, 4, "hv-1")
    c.log_read_rate(vol, "native RBD across the bridge", "hv-1")
    assert not peers(c, "stor-3", "( sport = :10809 )")  # nothing goes through stor-3's NBD export
    snap = c.cli("create-snapshot", vol, "--wait")["snapshot_id"]
    c.detach(vol, "hv-1")
    assert f"client.vbs.hv-1.{vol}" not in cephx_users(c)
    wait_until(lambda: not peers(c, "hv-1", f"( dst {ceph_1} )"), 60, 1, what="hv-1's librbd gone")

    c.cli("attach-volume", vol, "--host", "hv-2", "--vm", "vm2", "--wait")
    assert f"client.vbs.hv-2.{vol}" in cephx_users(c)
    assert c.checksum(vol, 4, "hv-2") == pattern_sha256(seed, 4)
    assert ceph_1 in peers(c, "hv-2", f"( dst {ceph_1} )")
    clone = c.cli("create-volume", "--snapshot", snap, "--wait")["volume_id"]
    (made,) = c.cli("describe-volumes", clone)["volumes"]
    assert made["storage_node"] == "stor-3", made
    c.cli("attach-volume", clone, "--host", "hv-2", "--vm", "vm2", "--device", "vdc", "--wait")
    assert c.checksum(clone, 4, "hv-2") == pattern_sha256(seed, 4)
    assert not peers(c, "stor-3", "( sport = :10809 )")
    for v in (vol, clone):
        c.detach(v, "hv-2")
        c.cli("delete-volume", v, "--wait")
    c.cli("delete-snapshot", snap, "--wait")
    assert not {u for u in cephx_users(c) if u.startswith("client.vbs.")}


def iscsi_peers(c: NetnsInstall) -> set[str]:
    """The addresses with an established connection to stor-2's iSCSI port (its tunnel), from its sockets."""
    proc = c.cluster.run(c.machines["stor-2"].machine, ["ss", "-Htn", "state", "established", "( sport = :3260 )"],
                         env={"PATH": "/usr/sbin:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return {line.split()[-1].rsplit(":", 1)[0] for line in proc.stdout.splitlines() if line.strip()} - {"127.0.0.1"}


def test_a_guest_writes_a_volume_of_the_iscsi_storage_node_through_its_tls_tunnel(netns_install: NetnsInstall) -> None:
    """stor-2 serves iSCSI (its tgtd on its own loopback, stunnel on its address): vm1 on hv-1 writes a volume
    there and reads it back; only hv-1's certificate gets through to tgtd while it holds the export."""
    c = netns_install
    vol = c.create("stor-2")
    with c.timed("attach over iscsi to a guest across the bridge (a tunnel end started)"):
        c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--wait")
        c.guest_disk(vol)
    c.write(vol, "iscsi", 4)
    c.log_read_rate(vol, "iSCSI through TLS across the bridge")
    assert iscsi_peers(c) == {c.machines["hv-1"].machine.address}  # QEMU's session, through hv-1's tunnel end
    assert iscsi_login(c, "hv-1", "stor-2", "hv-1") == "login-response"
    # Another machine's certificate of the same CA, without an export there: refused by the tunnel.
    assert iscsi_login(c, "hv-2", "stor-2", "hv-2") != "login-response"
    assert iscsi_login(c, "client", "stor-2", None) != "login-response"  # plaintext iSCSI
    # tgtd listens on stor-2's loopback, which no other machine reaches (theirs is their own).
    assert connect(c, "hv-1", "127.0.0.1", 3260) == "ConnectionRefusedError"
    assert connect(c, "stor-2", "127.0.0.1", 3260) == "open"
    c.detach(vol)
    wait_until(lambda: not iscsi_peers(c), 60, 1, what="hv-1's session to stor-2 closed")
    # The export went, and hv-1's pass with it (stunnel re-reads its admitted names on a signal).
    wait_until(lambda: iscsi_login(c, "hv-1", "stor-2", "hv-1") != "login-response", 60, 1, what="hv-1 refused")
    c.cli("delete-volume", vol, "--wait")


def test_a_volume_crosses_the_bridge_is_snapshotted_cloned_and_survives_a_controller_s_death(
        netns_install: NetnsInstall) -> None:
    c = netns_install
    vol = c.create("stor-1")
    c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--wait")
    seed = f"netns{int(time.time())}"
    c.write(vol, seed, 4)
    snap = c.cli("create-snapshot", vol, "--wait")["snapshot_id"]
    clone = c.cli("create-volume", "--snapshot", snap, "--wait")["volume_id"]
    c.cli("attach-volume", clone, "--host", "hv-1", "--vm", "vm1", "--device", "vdc", "--wait")
    assert c.checksum(clone, 4) == pattern_sha256(seed, 4)
    for v in (vol, clone):
        c.detach(v)
        c.cli("delete-volume", v, "--wait")
    c.cli("delete-snapshot", snap, "--wait")

    # The first controller dies; the second carries on (the CLI and the agents list both).
    first = c.runner.services["ctl-1"]
    first.send_signal(signal.SIGKILL)
    first.wait(60)
    vol = c.create("stor-1")
    c.cli("attach-volume", vol, "--host", "hv-2", "--vm", "vm2", "--wait")
    c.write(vol, "after", 1, "hv-2")
    c.detach(vol, "hv-2")
    c.cli("delete-volume", vol, "--wait")


def test_an_instance_live_migrates_to_the_other_hypervisor_node_with_its_volumes(netns_install: NetnsInstall) -> None:
    """vm1 moves from hv-1 to hv-2 (QEMU's stream over TLS across the bridge) with a volume of each storage
    node (NBD and iSCSI); what it wrote before, it reads after, on hv-2. Then the iSCSI volume moves to the
    NBD storage node under the running guest (its hypervisor mirrors it). Last in the module: vm1 stays
    on hv-2 (the first controller is dead by now: the second carries it all)."""
    c = netns_install
    hv2 = c.machines["hv-2"]
    vols = {"nbd": c.create("stor-1"), "iscsi": c.create("stor-2")}
    for (kind, vol), device in zip(vols.items(), ("vdb", "vdc"), strict=True):
        with c.timed(f"attach over {kind} to a guest across the bridge"):
            c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--device", device, "--wait")
            c.guest_disk(vol)
        c.write(vol, f"before-{device}", 2)
        c.log_read_rate(vol, f"{kind} through TLS across the bridge")
    (source,) = [i for i in c.cli("describe-instances")["instances"] if i["vm_id"] == "vm1" and i["host"] == "hv-1"]
    moved = c.guest("hv-2:vm1")
    try:
        # The orchestrator's part: the same VM waiting on hv-2 (QEMU -incoming defer).
        proc = c.cluster.run(hv2.machine, [str(c.runner.vbs_path), "demo-vm", "vm1", "--data-dir",
                                           str(hv2.path(HOST_DIR)), "--incoming"], env=c.runner.env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        with c.timed("vm1 reported incoming on hv-2"):
            wait_until(lambda: any(i["vm_id"] == "vm1" and i["host"] == "hv-2" and i["state"] == "incoming"
                                   for i in c.cli("describe-instances")["instances"]), 300, 1,
                       what="vm1 incoming on hv-2")
        with c.timed("migrate-instance hv-1 to hv-2"):
            c.cli("migrate-instance", source["instance_id"], "--host", "hv-2", "--wait")
        for device, vol in zip(("vdb", "vdc"), vols.values(), strict=True):
            assert c.checksum(vol, 2, "hv-2:vm1") == pattern_sha256(f"before-{device}", 2)
            c.write(vol, f"after-{device}", 1, "hv-2:vm1")
            (found,) = c.cli("describe-volumes", vol)["volumes"]
            assert [a["host"] for a in found["attachments"]] == ["hv-2"], found
        wait_until(lambda: iscsi_peers(c) == {hv2.machine.address}, 60, 1, what="the iSCSI session from hv-2 only")
        # hv-1's export went with the guest, and its pass with it.
        wait_until(lambda: iscsi_login(c, "hv-1", "stor-2", "hv-1") != "login-response", 60, 1, what="hv-1 refused")
        assert iscsi_login(c, "hv-2", "stor-2", "hv-2") == "login-response"

        # Each volume moves to the other storage node while the guest runs on it (its hypervisor mirrors
        # it, skipping what is unwritten: a write-zeroes on the new NBD export, a WRITE SAME with UNMAP on
        # the new thin-provisioned iSCSI LUN).
        with c.timed("migrate-volume of an attached 1 GiB volume, stor-2 (iSCSI) to stor-1 (NBD)"):
            c.cli("migrate-volume", vols["iscsi"], "--storage-node", "stor-1", "--wait")
        (found,) = c.cli("describe-volumes", vols["iscsi"])["volumes"]
        assert found["storage_node"] == "stor-1", found
        assert c.checksum(vols["iscsi"], 1, "hv-2:vm1") == pattern_sha256("after-vdc", 1)
        wait_until(lambda: not iscsi_peers(c), 60, 1, what="no iSCSI session left on stor-2")
        with c.timed("migrate-volume of an attached 1 GiB volume, stor-1 (NBD) to stor-2 (iSCSI)"):
            c.cli("migrate-volume", vols["nbd"], "--storage-node", "stor-2", "--wait")
        (found,) = c.cli("describe-volumes", vols["nbd"])["volumes"]
        assert found["storage_node"] == "stor-2", found
        assert c.checksum(vols["nbd"], 1, "hv-2:vm1") == pattern_sha256("after-vdb", 1)
        wait_until(lambda: iscsi_peers(c) == {hv2.machine.address}, 60, 1, what="hv-2's iSCSI session on stor-2")
        for vol in vols.values():
            c.detach(vol, "hv-2:vm1")
            c.cli("delete-volume", vol, "--wait")
    finally:
        moved.stop()
