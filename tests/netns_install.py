"""The namespace cluster of tests/test_netns_cluster.py as its tests drive it: the client machine's CLI, the
demo guests' consoles (what is checked inside the guests), the database's equivalents of the guide's
section 4, and probes of who reaches what across the bridge (a TCP connect, an iSCSI login through TLS).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from tests.conftest import wait_until
from tests.install_guide import CLUSTER_NET, GuideMachine, GuideRunner, section
from vbs.ids import virtio_serial
from vbs.rigs.netns import NetnsCluster
from vbs.rigs.postgres import EmbeddedPostgres
from vbs.rigs.testguest import pattern_sha256
from vbs.rigs.testguest.background import BackgroundGuest

log = logging.getLogger(__name__)

HOST_DIR = "/var/lib/vbs/host"  # the demo guests' data dir on the hypervisor nodes, as the guide gives it
GUESTS = {"hv-1": "vm1", "hv-2": "vm2"}


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
