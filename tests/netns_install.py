"""The namespace cluster of tests/test_netns_cluster.py and tests/test_netns_partitions.py: its install by
docs/install.md's commands (``netns_cluster``), and the cluster as their tests drive it: the client
machine's CLI, the demo guests' consoles (what is checked inside the guests), the database's equivalents
of the guide's section 4, and probes of who reaches what across the bridge (a TCP connect, an iSCSI login
through TLS).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import reap_daemons, wait_until
from tests.install_guide import CLUSTER_NET, GuideMachine, GuideRunner, GuideUser, section
from tests.installed import Installed, clean_env
from vbs.ids import virtio_serial
from vbs.rigs.ceph import EmbeddedCeph
from vbs.rigs.netns import GUIDE_MACHINES, NetnsCluster
from vbs.rigs.postgres import EmbeddedPostgres
from vbs.rigs.testguest import build_guest, default_cache_dir, pattern_sha256
from vbs.rigs.testguest.background import BackgroundGuest

log = logging.getLogger(__name__)

MACHINES = ("db", "ctl-1", "ctl-2", "stor-1", "stor-2", "hv-1", "hv-2", "client")
CONTROLLERS = ("ctl-1", "ctl-2")
CEPH_MACHINES = ("ceph-1", "stor-3")  # a Ceph cluster and the RBD storage node on it, when asked for
HOST_DIR = "/var/lib/vbs/host"  # the demo guests' data dir on the hypervisor nodes, as the guide gives it
GUESTS = {"hv-1": "vm1", "hv-2": "vm2"}


@dataclass
class NetnsInstall:
    cluster: NetnsCluster
    runner: GuideRunner
    machines: dict[str, GuideMachine]
    client_env: dict[str, str]
    database: EmbeddedPostgres | None = None  # the db machine's PostgreSQL, read by the tests over its socket
    ceph: EmbeddedCeph | None = None  # ceph-1's cluster (netns_cluster(ceph=True))

    def operations(self, resource_id: str) -> list[dict[str, Any]]:
        """The operations of a volume or snapshot as the database holds them, oldest first."""
        import psycopg
        from psycopg.rows import dict_row

        assert self.database is not None
        with psycopg.connect(host=str(self.database.run), port=self.database.port, user="vbs", dbname="vbs",
                             row_factory=dict_row) as conn:
            return list(conn.execute("SELECT id, kind, status, owner, fence, attempts, error FROM operations "
                                     "WHERE resource_id = %s ORDER BY created_at", (resource_id,)))

    def cli(self, *args: str, check: bool = True, via: str | None = None) -> Any:
        """``vbs -o json ARGS`` on the client machine, with the environment section 9 exports (both
        controllers), or to the controller machine ``via`` only."""
        r = self.runner
        env = {**r.env, **self.client_env}
        if via is not None:
            env["VBS_ENDPOINT"] = f"https://{self.machines[via].machine.address}:8770"
        proc = r.cluster.run(self.machines["client"].machine, [str(r.vbs_path), "-o", "json", *args], env=env,
                             timeout=600)
        if not check:
            return proc
        assert proc.returncode == 0, f"vbs {' '.join(args)}: {proc.stderr}"
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    @staticmethod
    @contextmanager
    def timed(what: str) -> Iterator[None]:
        """Log how long ``what`` took (figures for docs/benchmarks.md, never asserted)."""
        started = time.monotonic()
        yield
        log.info("netns cluster: %s took %.2f s", what, time.monotonic() - started)

    def create(self, node: str, size_gib: int = 1) -> str:
        """A volume made on the storage node ``node`` (stor-1 serves NBD, stor-2 iSCSI); its id."""
        return str(self.cli("create-volume", "--size", str(size_gib), "--storage-node", node, "--wait")["volume_id"])

    def node_up(self, command: str, collection: str, name: str) -> bool:
        proc = self.cli(command, check=False)
        return proc.returncode == 0 and any(n["name"] == name and n["state"] == "up"
                                            for n in json.loads(proc.stdout)[collection])

    def guest(self, host: str = "hv-1") -> BackgroundGuest:
        """The demo guest of ``host`` (vm1 on hv-1, vm2 on hv-2), or ``HOST:VM`` (a guest migrated there)."""
        machine, _, vm = host.partition(":")
        return BackgroundGuest(vm or GUESTS[machine], self.machines[machine].path(HOST_DIR))

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

    def log_read_rate(self, volume_id: str, what: str, host: str = "hv-1") -> None:
        """Log the guest's sequential read rate of ``volume_id`` (dd of 64 MiB after dropping its caches, as
        the guest's clock times it): a figure for docs/benchmarks.md, never asserted."""
        dev = self.guest_disk(volume_id, host)
        out = self.guest_run(f"echo 3 > /proc/sys/vm/drop_caches; read a _ < /proc/uptime; dd if=/dev/{dev} "
                             f"of=/dev/null bs=1M count=64 2>/dev/null; read b _ < /proc/uptime; echo $a $b", host)
        started, ended = (float(t) for t in out.split()[-2:])
        log.info("netns cluster: a guest reads %s at %.1f MiB/s", what, 64 / max(0.01, ended - started))

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


def start_ceph(cluster: NetnsCluster, ceph_1: GuideMachine) -> Future[EmbeddedCeph]:
    """Ceph's own install is not the guide's, so a single-node cluster (``vbs.rigs.ceph``) in ceph-1's
    namespace on its address and Ceph's own ports, its ceph.conf and admin keyring in ceph-1's /etc/ceph.
    It starts in a thread of its own while the rest of the cluster is installed (its start is mostly
    waiting for the mon and the PGs); stopped by its PIDs, the OSD first, once its start has ended (it
    stops what it started if the start fails) and after every process started later (stor-3's agent)."""
    etc = ceph_1.path("/etc/ceph").parent  # the cluster's directory is ceph-1's /etc/ceph
    assert etc.is_relative_to(ceph_1.root), etc
    ceph = EmbeddedCeph(etc, address=ceph_1.machine.address, netns=ceph_1.machine.netns)
    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ceph-1")

    def start() -> EmbeddedCeph:
        with NetnsInstall.timed("a single-node Ceph in its namespace, up to all PGs active+clean"):
            ceph.start()
        return ceph

    started = starter.submit(start)

    def stop() -> None:
        try:
            started.exception()  # wait: never stop daemons while they are being started
        finally:
            ceph.stop()
            starter.shutdown()

    cluster.processes.callback(stop)
    return started


def join_ceph_storage_node(install: NetnsInstall, ceph: EmbeddedCeph) -> None:
    """The guide's "A Ceph RBD storage node" on ``ceph`` (ceph-1's cluster): its blocks on ceph-1 (VBS's
    pool, the node's cephx user), the credential lines for stor-3 on ctl-1 (stor-1's with its name and
    address, as for stor-2), and the node's own blocks on stor-3."""
    runner, machines = install.runner, install.machines
    install.ceph = ceph
    with install.timed("the guide's Ceph and RBD storage node blocks, up to the node's pool reported"):
        ceph_blocks, node_blocks = section("A Ceph RBD")[:2], section("A Ceph RBD")[2:]
        runner.run_blocks(ceph_blocks, "ceph-1")
        ceph.wait_clean()
        ceph.wait_pool_stats("vbs")
        node_credentials(runner, "stor-3", "storage", record=False)
        install.cluster.processes.callback(reap_daemons, machines["stor-3"].path("/var/lib/vbs/storage"))
        runner.run_blocks(node_blocks, "stor-3")
        wait_until(lambda: install.node_up("describe-storage-nodes", "storage_nodes", "stor-3"), 300, 1,
                   what="stor-3")


def node_credentials(runner: GuideRunner, node: str, kind: str, *, record: bool = True) -> None:
    """The credentials' per-node block on ctl-1 (a certificate and a token) for ``node`` of ``kind``
    (storage or host), its variables set as the guide says for each node."""
    blocks = section("Credentials and certificates")[1:]
    assert blocks[0].startswith("# per node"), blocks[0]
    runner.run_blocks(blocks, "ctl-1", variables={"NODE": node, "KIND": kind,
                                                  "NODE_ADDR": runner.machines[node].machine.address},
                      record=record)


def connect(install: NetnsInstall, source: str, host: str, port: int) -> str:
    code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close();"
            " print('open')\nexcept OSError as e:\n print(type(e).__name__)")
    proc = install.cluster.run(install.machines[source].machine, [sys.executable, "-c", code, host, str(port)],
                               env={"PATH": "/usr/bin:/bin"})
    return proc.stdout.strip()


# An iSCSI login request (RFC 7143 §11.12: a discovery session's first PDU) through TLS with a machine's
# certificate; prints what came back: "login-response" (opcode 0x23: tgtd answered), "closed", or the
# error's name. The certificate's key stays in its file (a path in argv).
ISCSI_LOGIN = """
import socket, ssl, sys
host, port, ca, cert, key = sys.argv[1:6]
body = b"InitiatorName=iqn.2026-11.org.vbs:probe\\0SessionType=Discovery\\0AuthMethod=None\\0"
pdu = bytearray(48)
pdu[0], pdu[1] = 0x43, 0x81  # immediate login request; transit from security negotiation
pdu[5:8] = len(body).to_bytes(3, "big")
pdu[8:14] = bytes([0, 2, 0x3d, 0, 0, 1])
pdu[16:20] = (1).to_bytes(4, "big")
pdu[24:28] = (1).to_bytes(4, "big")
try:
    raw = socket.create_connection((host, int(port)), timeout=60)
    if cert == "-":
        s = raw
    else:
        ctx = ssl.create_default_context(cafile=ca)
        ctx.load_cert_chain(cert, key)
        s = ctx.wrap_socket(raw, server_hostname=host)
    s.sendall(bytes(pdu) + body + bytes(-len(body) % 4))
    head = s.recv(48)
    print("login-response" if head and head[0] & 0x3f == 0x23 else "closed")
except (OSError, ssl.SSLError) as e:
    print(type(e).__name__)
"""


def iscsi_login(install: NetnsInstall, source: str, target: str, cert_of: str | None) -> str:
    """An iSCSI login from machine ``source`` to ``target``:3260, through TLS with the certificate of
    ``cert_of`` (its files on that machine, the install's CA), or in plaintext (None)."""
    m = install.machines
    tls = m[cert_of] if cert_of is not None else None
    files = [str(tls.path(f"/etc/vbs/tls/{n}")) for n in ("ca.pem", f"{cert_of}.pem", f"{cert_of}-key.pem")] \
        if tls is not None else ["-", "-", "-"]
    proc = install.cluster.run(m[source].machine, [sys.executable, "-c", ISCSI_LOGIN, m[target].machine.address,
                                                   "3260", *files], env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@contextmanager
def netns_cluster(installed: Installed, *, ceph: bool = False) -> Iterator[NetnsInstall]:
    """The cluster of docs/install.md on namespaces, installed by its commands from the wheel (the module
    docstring of tests/test_netns_cluster.py says what runs); ``ceph``: with a Ceph cluster (ceph-1) and
    an RBD storage node on it (stor-3), last; everything stopped and removed on exit, the user ``vbs``
    last (if made here: ``GuideUser``).

    The controllers run as ``vbs``, as the guide has them: their machines' directories are 0755 (a
    machine's ``/``) under a root ``vbs`` may enter (0711), and ``installed``'s venv is readable by all
    (tests/conftest.py); their data dirs are the guide's (0700, ``vbs``'s)."""
    build_guest()  # the demo guest's image, in the cache VBS_CACHE_DIR names below
    # Short paths (the export daemons' and monitors' sockets live under them), enterable by postgres.
    root = Path(tempfile.mkdtemp(prefix="vbsnc", dir="/tmp"))
    root.chmod(0o711)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        user = stack.enter_context(GuideUser())  # removed after every process (the controllers run as it)
        cluster = stack.enter_context(NetnsCluster(f"vbsnc{os.getpid() % 100000}"))
        machines = {n: GuideMachine(cluster.add(n, GUIDE_MACHINES[n]), root / n)
                    for n in MACHINES + (CEPH_MACHINES if ceph else ())}
        for name, m in machines.items():
            # postgres enters db's (rigs/postgres.py), vbs its controllers' (a machine's / is 0755).
            m.root.mkdir()
            m.root.chmod(0o755 if name in CONTROLLERS else 0o711 if name == "db" else 0o700)
            m.path("/root/").mkdir(mode=0o700)  # root's home, where the guide keeps the database's password
        ceph_started = start_ceph(cluster, machines["ceph-1"]) if ceph else None
        env = clean_env(installed.root / "home", VBS_CACHE_DIR=str(default_cache_dir().parent))
        runner = GuideRunner(cluster, machines, installed.vbs, env, root, user)
        for name in ("ctl-1", "ctl-2", "stor-1", "hv-1"):
            runner.run_blocks(section("3."), name)
        first = section("5.")
        assert "ALTER ROLE" in first[3]  # the database's password is set there: the database runs by then
        runner.run_blocks(first[:2], "ctl-1")
        pg = start_database(cluster, runner, stack)
        runner.on_sql = alter_role(pg)
        runner.run_blocks(first[2:], "ctl-1")
        credentials = section("Credentials and certificates")
        runner.run_blocks(credentials[:1], "ctl-1")  # the further controller's certificate
        for node, kind in (("stor-1", "storage"), ("hv-1", "host")):  # the guide's own nodes
            node_credentials(runner, node, kind)
        runner.run_blocks(section("6."), "ctl-2")
        # After the storage agent's stop (by its PID): any export daemon a crash of it left, by its pidfile.
        cluster.processes.callback(reap_daemons, machines["stor-1"].path("/var/lib/vbs/storage"))
        runner.run_blocks(section("7."), "stor-1")
        # After the host agents' stops: the host ends of the iSCSI tunnels they leave running on purpose
        # (docs/install.md "The units"), by their pidfiles.
        for name in ("hv-1", "hv-2"):
            cluster.processes.callback(reap_daemons, machines[name].path(HOST_DIR))
        runner.run_blocks(section("8."), "hv-1")
        # A further hypervisor node, as the guide's "and each further one" says: the credentials' per-node
        # block with hv-2's name and address, then section 8 with hv-2's variables.
        node_credentials(runner, "hv-2", "host", record=False)
        runner.run_blocks(section("8."), "hv-2", variables={"NAME": "hv-2", "ADDR": machines["hv-2"].machine.address},
                          record=False)
        # Section 9 from the client machine, which has the CA and the key (copies of ctl-1's).
        client = machines["client"]
        client.path("/var/lib/vbs/controller").mkdir(parents=True, mode=0o700)
        for name in ("ca.pem", "credentials"):
            shutil.copy2(machines["ctl-1"].path(f"/var/lib/vbs/controller/{name}"),
                         client.path(f"/var/lib/vbs/controller/{name}"))
        client_env: dict[str, str] = {}
        done = NetnsInstall(cluster, runner, machines, client_env, pg)
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
        # The iSCSI storage node, stor-2, as section 7's "iSCSI" says: the credentials' per-node block with
        # its name and address, then section 7 with its variables and EXPORT=iscsi (its tgtd and stunnel
        # are the agent's, stopped by it; any it left, by their pidfiles).
        node_credentials(runner, "stor-2", "storage", record=False)
        cluster.processes.callback(reap_daemons, machines["stor-2"].path("/var/lib/vbs/storage"))
        runner.run_blocks(section("7."), "stor-2", variables={"NAME": "stor-2", "EXPORT": "iscsi",
                                                              "ADDR": machines["stor-2"].machine.address},
                          record=False)
        wait_until(lambda: done.node_up("describe-storage-nodes", "storage_nodes", "stor-2"), 300, 1, what="stor-2")
        if ceph_started is not None:
            join_ceph_storage_node(done, ceph_started.result())
        yield done
