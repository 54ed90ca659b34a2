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
attach. boto3 on the client machine drives the EC2 API over TLS. Every process is stopped by
its PID and every namespace is gone at the end (the rig fails the teardown if a process was left in one).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from tests.conftest import reap_daemons, wait_until
from tests.install_guide import CLUSTER_NET, GUIDE_NET, GuideMachine, GuideRunner, section, vbs_lines
from tests.installed import Installed, clean_env, install
from vbs.ids import virtio_serial
from vbs.rigs.netns import GUIDE_MACHINES, NetnsCluster
from vbs.rigs.postgres import EmbeddedPostgres
from vbs.rigs.testguest import build_guest, default_cache_dir, pattern_sha256
from vbs.rigs.testguest.background import BackgroundGuest

pytestmark = pytest.mark.integration

MACHINES = ("db", "ctl-1", "ctl-2", "stor-1", "hv-1", "hv-2", "client")
HOST_DIR = "/var/lib/vbs/host"  # the demo guests' data dir on the hypervisor nodes, as the guide gives it
GUESTS = {"hv-1": "vm1", "hv-2": "vm2"}
# Sections of the guide run here, in order: all but the packages, the wheelhouse (tests/installed.py
# builds it), PostgreSQL's packaged cluster (its equivalent below), the units' notes and the upgrades.
RUN = ("3.", "5.", "Credentials and certificates", "6.", "7.", "8.", "9.")


@dataclass
class NetnsInstall:
    cluster: NetnsCluster
    runner: GuideRunner
    machines: dict[str, GuideMachine]
    client_env: dict[str, str]

    def cli(self, *args: str, check: bool = True) -> Any:
        """``vbs -o json ARGS`` on the client machine, with the environment section 9 exports."""
        r = self.runner
        proc = r.cluster.run(self.machines["client"].machine, [str(r.vbs_path), "-o", "json", *args],
                             env={**r.env, **self.client_env}, timeout=600)
        if not check:
            return proc
        assert proc.returncode == 0, f"vbs {' '.join(args)}: {proc.stderr}"
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    def node_up(self, command: str, collection: str, name: str) -> bool:
        proc = self.cli(command, check=False)
        return proc.returncode == 0 and any(n["name"] == name and n["state"] == "up"
                                            for n in json.loads(proc.stdout)[collection])

    def guest(self, host: str = "hv-1") -> BackgroundGuest:
        """The demo guest of ``host`` (vm1 on hv-1, vm2 on hv-2)."""
        return BackgroundGuest(GUESTS[host], self.machines[host].path(HOST_DIR))

    def guest_disk(self, volume_id: str, host: str = "hv-1") -> str:
        """The guest's device of ``volume_id`` (found by its serial), once the guest sees it."""
        serial = virtio_serial(volume_id)
        return str(wait_until(lambda: next((d.device for d in self.guest(host).disks() if d.serial == serial),
                                           None), 120, 1, what=f"{volume_id} in the guest of {host}"))

    def guest_run(self, command: str, host: str = "hv-1") -> str:
        status, out = self.guest(host).run(command, 300)
        assert status == 0, f"{command}: {status} {out}"
        return out

    def write(self, volume_id: str, seed: str, mib: int, host: str = "hv-1") -> None:
        """``pattern_bytes(seed, mib)`` written to ``volume_id`` by the guest of ``host``, and read back."""
        dev = self.guest_disk(volume_id, host)
        self.guest_run(f"yes {seed} | head -c {mib << 20} | dd of=/dev/{dev} bs=1M conv=fsync 2>/dev/null", host)
        assert self.checksum(volume_id, mib, host) == pattern_sha256(seed, mib)

    def checksum(self, volume_id: str, mib: int, host: str = "hv-1") -> str:
        """sha256 of the first ``mib`` MiB of ``volume_id`` as the guest of ``host`` reads it from the disk."""
        dev = self.guest_disk(volume_id, host)
        read = f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/{dev} bs=1M count={mib} 2>/dev/null | sha256sum"
        return self.guest_run(read, host).split()[0]

    def detach(self, volume_id: str, host: str = "hv-1") -> None:
        self.cli("detach-volume", volume_id, "--wait")
        wait_until(lambda: virtio_serial(volume_id) not in {d.serial for d in self.guest(host).disks()}, 120, 1,
                   what=f"{volume_id} gone from the guest of {host}")


def start_database(cluster: NetnsCluster, runner: GuideRunner, stack: ExitStack) -> EmbeddedPostgres:
    """Section 4's equivalent: Debian's packaged cluster is not run here (no systemd), so a cluster of
    its own in the db namespace, listening on db's address with TLS (a certificate of the install's CA
    for that address, where Debian's has a self-signed one), with the guide's pg_hba line and the
    database ``vbs`` (createdb); its role ``vbs`` is made by initdb."""
    db, ctl1 = runner.machines["db"], runner.machines["ctl-1"]
    (hba,) = [line for line in section("4.")[1].splitlines() if line.startswith('echo "hostssl')]
    db.variables["CONTROLLER_NET"] = f"{CLUSTER_NET}0/24"
    certs = db.root / "tls"
    proc = cluster.run(ctl1.machine, [str(runner.vbs_path), "issue-cert", "db", "--host", db.machine.address,
                                      "--data-dir", str(ctl1.path("/var/lib/vbs/controller")), "--out-dir", str(certs)],
                       env=runner.env)
    assert proc.returncode == 0, proc.stderr
    pg = EmbeddedPostgres(db.root, 5432, listen=db.machine.address, netns=db.machine.netns,
                          settings={"ssl": "on", "ssl_cert_file": "server.pem", "ssl_key_file": "server-key.pem"})
    pg.prepare()
    for name, target in (("db.pem", "server.pem"), ("db-key.pem", "server-key.pem")):
        shutil.copyfile(certs / name, pg.data / target)
        shutil.chown(pg.data / target, "postgres", "postgres")
        (pg.data / target).chmod(0o600)
    with (pg.data / "pg_hba.conf").open("a") as f:
        f.write(db.expand(hba.split('"')[1]) + "\n")
    stack.callback(pg.stop)
    pg.start()
    pg.create_database("vbs")
    return pg


def alter_role(pg: EmbeddedPostgres) -> Any:
    """The guide's ``… | runuser -u postgres -- psql``: the same statement, over the cluster's socket."""
    def run(statement: str) -> None:
        import psycopg

        with psycopg.connect(host=str(pg.run), port=pg.port, user="vbs", dbname="postgres", autocommit=True) as c:
            c.execute(statement.encode())
    return run


@pytest.fixture(scope="module")
def netns_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsInstall]:
    installed: Installed = install(tmp_path_factory.mktemp("install"))
    build_guest()  # the demo guest's image, in the cache VBS_CACHE_DIR names below
    # Short paths (the export daemons' and monitors' sockets live under them), enterable by postgres.
    root = Path(tempfile.mkdtemp(prefix="vbsnc", dir="/tmp"))
    root.chmod(0o711)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        cluster = stack.enter_context(NetnsCluster(f"vbsnc{os.getpid() % 100000}"))
        machines = {n: GuideMachine(cluster.add(n, GUIDE_MACHINES[n]), root / n) for n in MACHINES}
        for name, m in machines.items():
            m.root.mkdir(mode=0o711 if name == "db" else 0o700)  # postgres enters db's (rigs/postgres.py)
            m.path("/root/").mkdir(mode=0o700)  # root's home, where the guide keeps the database's password
        env = clean_env(installed.root / "home", VBS_CACHE_DIR=str(default_cache_dir().parent))
        runner = GuideRunner(cluster, machines, installed.vbs, env, root)
        for name in ("ctl-1", "ctl-2", "stor-1", "hv-1"):
            runner.run_blocks(section("3."), name)
        first = section("5.")
        assert "ALTER ROLE" in first[3]  # the database's password is set there: the database runs by then
        runner.run_blocks(first[:2], "ctl-1")
        pg = start_database(cluster, runner, stack)
        runner.on_sql = alter_role(pg)
        runner.run_blocks(first[2:], "ctl-1")
        runner.run_blocks(section("Credentials and certificates"), "ctl-1")
        runner.run_blocks(section("6."), "ctl-2")
        # After the storage agent's stop (by its PID): any export daemon a crash of it left, by its pidfile.
        cluster.processes.callback(reap_daemons, machines["stor-1"].path("/var/lib/vbs/storage"))
        runner.run_blocks(section("7."), "stor-1")
        runner.run_blocks(section("8."), "hv-1")
        # A further hypervisor node, as the guide's "and each further one" says: hv-1's lines of its
        # credentials block with hv-2's name and address, then section 8 with hv-2's variables.
        further = [line.replace("hv-1", "hv-2").replace(f"{GUIDE_NET}30", f"{GUIDE_NET}31")
                   for line in section("Credentials and certificates")[0].splitlines() if " hv-1 " in line]
        assert len(further) == 2
        runner.run_blocks(["\n".join(further)], "ctl-1", record=False)
        runner.run_blocks(section("8."), "hv-2", variables={"NAME": "hv-2", "ADDR": machines["hv-2"].machine.address},
                          record=False)
        # Section 9 from the client machine, which has the CA and the key (copies of ctl-1's).
        client = machines["client"]
        client.path("/var/lib/vbs/controller").mkdir(parents=True, mode=0o700)
        for name in ("ca.pem", "credentials"):
            shutil.copy2(machines["ctl-1"].path(f"/var/lib/vbs/controller/{name}"),
                         client.path(f"/var/lib/vbs/controller/{name}"))
        client_env: dict[str, str] = {}
        done = NetnsInstall(cluster, runner, machines, client_env)
        checks = section("9.")
        runner.run_blocks(checks[:1], "client", client_env)
        wait_until(lambda: done.node_up("describe-storage-nodes", "storage_nodes", "stor-1"), 300, 1, what="stor-1")
        wait_until(lambda: done.node_up("describe-hosts", "hosts", "hv-1"), 300, 1, what="hv-1")
        runner.run_blocks(checks[1:2], "client", client_env)
        stack.callback(lambda: done.guest("hv-1").stop())  # the demo guest's QEMU, by the PID in its pidfile
        runner.run_blocks(checks[2:3], "client", client_env)  # vbs demo-vm, on hv-1
        wait_until(lambda: any(i["vm_id"] == "vm1" and i["state"] == "running"
                               for i in done.cli("describe-instances")["instances"]), 300, 1, what="vm1")
        runner.run_blocks(checks[3:], "client", client_env)
        # The same guest on hv-2 (vm2), by the guide's command with its name.
        stack.callback(lambda: done.guest("hv-2").stop())
        hv2 = machines["hv-2"]
        proc = cluster.run(hv2.machine, [str(installed.vbs), "demo-vm", "vm2", "--data-dir", str(hv2.path(HOST_DIR))],
                           env=runner.env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: any(i["vm_id"] == "vm2" and i["host"] == "hv-2" and i["state"] == "running"
                               for i in done.cli("describe-instances")["instances"]), 300, 1, what="vm2")
        yield done


def test_the_guide_s_commands_install_a_cluster_of_namespaces(netns_install: NetnsInstall) -> None:
    """Every vbs line of the sections run was run; every service is up, apart, on its own address."""
    expected = [line for title in RUN for line in vbs_lines(section(title))]
    ran = netns_install.runner.ran
    assert sorted(ran) == sorted(expected * 1 + vbs_lines(section("3.")) * 3)  # section 3 on each of 4 machines
    nodes = netns_install.cli("describe-storage-nodes")["storage_nodes"]
    (stor,) = [n for n in nodes if n["name"] == "stor-1"]
    assert stor["url"] == f"https://{CLUSTER_NET}20:8771", stor
    (hv,) = [h for h in netns_install.cli("describe-hosts")["hosts"] if h["name"] == "hv-1"]
    assert hv["url"] == f"https://{CLUSTER_NET}30:8772", hv
    controllers = netns_install.cli("describe-controllers")["controllers"]
    assert sorted(c["state"] for c in controllers) == ["up", "up"], controllers


def connect(install: NetnsInstall, source: str, host: str, port: int) -> str:
    code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close();"
            " print('open')\nexcept OSError as e:\n print(type(e).__name__)")
    proc = install.cluster.run(install.machines[source].machine, [sys.executable, "-c", code, host, str(port)],
                               env={"PATH": "/usr/bin:/bin"})
    return proc.stdout.strip()


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
    vol = c.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--wait")
    c.write(vol, "moved", 4, "hv-1")
    c.detach(vol, "hv-1")
    c.cli("attach-volume", vol, "--host", "hv-2", "--vm", "vm2", "--wait")
    assert c.checksum(vol, 4, "hv-2") == pattern_sha256("moved", 4)
    c.detach(vol, "hv-2")
    c.cli("delete-volume", vol, "--wait")


def test_a_volume_crosses_the_bridge_is_snapshotted_cloned_and_survives_a_controller_s_death(
        netns_install: NetnsInstall) -> None:
    c = netns_install
    vol = c.cli("create-volume", "--size", "1", "--wait")["volume_id"]
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
    vol = c.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    c.cli("attach-volume", vol, "--host", "hv-2", "--vm", "vm2", "--wait")
    c.write(vol, "after", 1, "hv-2")
    c.detach(vol, "hv-2")
    c.cli("delete-volume", vol, "--wait")
