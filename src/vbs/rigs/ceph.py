"""An embedded single-node Ceph cluster (Debian's Ceph 16): what the rbd tests and
``scripts/single-node-ceph`` run.

The cluster lives in ``<parent>/ceph/`` (mode 0700): ``ceph.conf``, its keyrings (0600), one mon,
one mgr and N bluestore OSDs whose block devices are sparse files, their logs, run files and admin
sockets, all inside that directory. It listens on 127.0.0.1 only, the mon on free ports; clients
find it through ``ceph.conf`` and ``ceph.client.admin.keyring`` (the key never appears on an argv).
Or, for a machine of a namespace cluster (``vbs.rigs.netns``), on that machine's address with Ceph's
own monitor ports (3300 and 6789: the namespace has them to itself), every daemon and tool run in its
namespace (``ip netns exec``, which executes the daemon in its own place: its PID is the daemon's).

Every daemon is this process's child, started from an argv list with a minimal environment and
stopped by its PID (SIGTERM, then SIGKILL): the OSDs first, then the mgr, the mon last, so no OSD is
left waiting for a mon that has gone.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from vbs.errors import DriverError, InvalidParameter
from vbs.net.ports import PortPicker
from vbs.system.processes import minimal_environment, stop_child

__all__ = ["EmbeddedCeph", "CLUSTER_DIR", "pgs_all_clean"]

CLUSTER_DIR = "ceph"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 60.0
_POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MON_ID = "a"
LOOPBACK = "127.0.0.1"
MON_PORTS = (3300, 6789)  # Ceph's own (msgr2, msgr1): a cluster on an address of its own takes them
_NETNS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MGR_ID = "x"


def pgs_all_clean(status: dict[str, Any], osds: int) -> bool:
    """Whether ``ceph status --format json`` shows ``osds`` OSDs up and in and every PG active+clean."""
    osdmap = status.get("osdmap", {})
    osdmap = osdmap.get("osdmap", osdmap)  # older releases nest it once more
    if osdmap.get("num_up_osds") != osds or osdmap.get("num_in_osds") != osds:
        return False
    pgmap = status.get("pgmap", {})
    total = pgmap.get("num_pgs", -1)
    clean = sum(int(s.get("count", 0)) for s in pgmap.get("pgs_by_state", [])
                if s.get("state_name") == "active+clean")
    return isinstance(total, int) and total >= 0 and clean == total


class EmbeddedCeph:
    """One cluster in ``parent/ceph``: ``start()``, ``create_pool(name)``, ``stop()``; ``conf_path``."""

    def __init__(self, parent: Path, osds: int = 1, *, osd_size_gib: int = 10, address: str = LOOPBACK,
                 netns: str | None = None) -> None:
        if not 1 <= osds <= 8:
            raise InvalidParameter(f"osds must be 1-8, not {osds}")
        if ipaddress.ip_address(address).version != 4:
            raise InvalidParameter(f"the cluster listens on an IPv4 address, not {address!r}")
        if netns is not None and not _NETNS_RE.fullmatch(netns):
            raise InvalidParameter(f"invalid network namespace name {netns!r}")
        self.address = address
        self.netns = netns
        self.parent = parent.resolve()
        self.root = self.parent / CLUSTER_DIR
        self.conf_path = self.root / "ceph.conf"
        self.admin_keyring = self.root / "ceph.client.admin.keyring"
        self.osds = osds
        self.osd_size_gib = osd_size_gib
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- set-up --------------------------------------------------------------------------------

    def _write_conf(self, fsid: str, v2_port: int, v1_port: int) -> None:
        r = self.root
        # The MACHINE-FACTS settings for one node: size-1 pools, OSD-level CRUSH choice, no autoscaler,
        # fast paxos (else every snapshot takes a second), no near-full disk alarms on a test machine.
        text = f"""[global]
fsid = {fsid}
mon initial members = {_MON_ID}
mon host = {self._mon_addrs(v2_port, v1_port)}
public network = {"127.0.0.0/8" if self.address == LOOPBACK else f"{self.address}/32"}
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
paxos propose interval = 0.1
mon data avail warn = 2
mon data avail crit = 1
run dir = {r}/run
log file = {r}/log/$name.log
mon cluster log file = {r}/log/cluster.log
admin socket = {r}/run/$name.asok
crash dir = {r}/crash
exporter sock dir = {r}/run
mon data = {r}/mon/$cluster-$id
mgr data = {r}/mgr/$cluster-$id
osd data = {r}/osd/$cluster-$id
osd objectstore = bluestore
bluestore block create = true
bluestore block size = {self.osd_size_gib}G
osd memory target = 939524096
bluestore cache autotune = true
ms bind ipv4 = true
ms bind ipv6 = false

[mon]
keyring = $mon_data/keyring

[mgr]
keyring = $mgr_data/keyring
mgr initial modules = iostat

[osd]
keyring = $osd_data/keyring

[client]
keyring = {r}/$cluster.$name.keyring
admin socket =
log file =
"""
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def _mon_addrs(self, v2_port: int, v1_port: int) -> str:
        return f"[v2:{self.address}:{v2_port},v1:{self.address}:{v1_port}]"

    def _in_netns(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns is not None else argv

    def run_tool(self, argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
        """A Ceph tool run to its end in the cluster's directory; its stdout. Failures name the tool and its
        stderr."""
        try:
            proc = subprocess.run(self._in_netns(argv), env=minimal_environment(), cwd=self.root,  # noqa: S603
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DriverError(f"{' '.join(argv[:2])} did not finish within {timeout:g}s") from None
        if proc.returncode != 0:
            raise DriverError(f"{' '.join(argv[:3])} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        return proc.stdout

    def ceph(self, *args: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """``ceph ARGS`` as client.admin on this cluster."""
        return self.run_tool(["ceph", "--conf", str(self.conf_path), "--id", "admin",
                          "--connect-timeout", str(int(timeout)), *args], timeout=timeout + 5)

    def start_daemon(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """A daemon of this cluster started as this process's child, in its own session, its output in
        ``log/<name>.stdout``; the caller stops it by its PID."""
        log_fd = os.open(self.root / "log" / f"{name}.stdout", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            return subprocess.Popen(self._in_netns(argv), env=minimal_environment(), cwd=self.root,  # noqa: S603
                                    stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            os.close(log_fd)

    def _spawn(self, name: str, argv: list[str]) -> None:
        self._procs[name] = self.start_daemon(name, argv)

    def _bootstrap_mon(self) -> None:
        fsid = str(uuid.uuid4())
        if self.address == LOOPBACK:
            ports = PortPicker()
            v2_port, v1_port = ports(), ports()
        else:
            v2_port, v1_port = MON_PORTS
        self._write_conf(fsid, v2_port, v1_port)
        conf = ["--conf", str(self.conf_path)]
        mon_keyring = self.root / "mon.keyring"
        self.run_tool(["ceph-authtool", "--create-keyring", str(mon_keyring), "--gen-key", "-n", "mon.",
                   "--cap", "mon", "allow *"])
        self.run_tool(["ceph-authtool", "--create-keyring", str(self.admin_keyring), "--gen-key", "-n", "client.admin",
                   "--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *",
                   "--cap", "mds", "allow *"])
        self.run_tool(["ceph-authtool", str(mon_keyring), "--import-keyring", str(self.admin_keyring)])
        monmap = self.root / "monmap"
        self.run_tool(["monmaptool", "--create", "--fsid", fsid, "--addv", _MON_ID,
                   self._mon_addrs(v2_port, v1_port), str(monmap)])
        self.run_tool(["ceph-mon", *conf, "--mkfs", "-i", _MON_ID, "--monmap", str(monmap),
                       "--keyring", str(mon_keyring)])
        for f in (mon_keyring, self.admin_keyring):
            f.chmod(0o600)

    def _prepare_mgr(self) -> None:
        mgr_dir = self.root / "mgr" / f"ceph-{_MGR_ID}"
        mgr_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ceph("auth", "get-or-create", f"mgr.{_MGR_ID}", "mon", "allow profile mgr", "osd", "allow *",
                  "mds", "allow *", "-o", str(mgr_dir / "keyring"))
        (mgr_dir / "keyring").chmod(0o600)

    def _prepare_osd(self) -> int:
        osd_uuid = str(uuid.uuid4())
        osd_id = int(self.ceph("osd", "new", osd_uuid).strip())
        osd_dir = self.root / "osd" / f"ceph-{osd_id}"
        osd_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_tool(["ceph-osd", "--conf", str(self.conf_path), "-i", str(osd_id), "--mkfs", "--mkkey",
                   "--osd-uuid", osd_uuid, "--no-mon-config"], timeout=120)
        (osd_dir / "keyring").chmod(0o600)
        self.ceph("auth", "add", f"osd.{osd_id}", "osd", "allow *", "mon", "allow profile osd",
                  "mgr", "allow profile osd", "-i", str(osd_dir / "keyring"))
        return osd_id

    # -- running -------------------------------------------------------------------------------

    def start(self) -> None:
        """Make the cluster (the first time), start its daemons and wait until every PG is active+clean."""
        self.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.root.chmod(0o700)
        for sub in ("run", "log", "crash", "mon", "mgr", "osd"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        fresh = not self.conf_path.exists()
        try:
            if fresh:
                self._bootstrap_mon()
            conf = ["--conf", str(self.conf_path)]
            self._spawn(f"mon.{_MON_ID}", ["ceph-mon", *conf, "-f", "-i", _MON_ID])
            if fresh:
                self._prepare_mgr()
                # Clones without protecting their snapshot first (clone v2).
                self.ceph("osd", "set-require-min-compat-client", "mimic")
                osd_ids = [self._prepare_osd() for _ in range(self.osds)]
            else:
                osd_ids = self.osd_ids()
            self._spawn(f"mgr.{_MGR_ID}", ["ceph-mgr", *conf, "-f", "-i", _MGR_ID])
            for osd_id in osd_ids:
                self._spawn(f"osd.{osd_id}", ["ceph-osd", *conf, "-f", "-i", str(osd_id)])
            self.wait_clean()
        except BaseException:
            self.stop()
            raise

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.ceph("status", "--format", "json", timeout=20))
        return out

    def wait_clean(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until all OSDs are up and in and every PG is active+clean (HEALTH_OK comes earlier)."""
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise DriverError(f"Ceph {name} exited (code {proc.returncode}); see {self.root / 'log'}")
            try:
                if pgs_all_clean(self.status(), self.osds):
                    return
            except DriverError:
                pass  # the mon is not answering yet
            if time.monotonic() > deadline:
                raise DriverError(f"the Ceph cluster in {self.root} was not active+clean within {timeout:g}s")
            time.sleep(0.3)

    def create_pool(self, name: str, size: int = 1, pg_num: int = 8, *, min_size: int = 1) -> None:
        """An RBD pool of ``size`` replicas (idempotent) that takes writes while ``min_size`` of them are
        up, ready once its PGs are active+clean."""
        if not _POOL_NAME_RE.fullmatch(name):
            raise InvalidParameter(f"invalid Ceph pool name {name[:64]!r}")
        if not 1 <= size <= self.osds:
            raise InvalidParameter(f"a pool of size {size} needs as many OSDs (this cluster has {self.osds})")
        if not 1 <= min_size <= size:
            raise InvalidParameter(f"min_size must be 1-{size}, not {min_size}")
        self.ceph("osd", "pool", "create", name, str(pg_num), str(pg_num), "replicated")
        self.ceph("osd", "pool", "set", name, "size", str(size), "--yes-i-really-mean-it")
        self.ceph("osd", "pool", "set", name, "min_size", str(min_size))
        self.ceph("osd", "pool", "application", "enable", name, "rbd")
        self.wait_clean()
        self.wait_pool_stats(name)

    def wait_pool_stats(self, name: str, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until ``ceph df`` reports the pool with free space: the mgr publishes a new pool's
        stats seconds after its PGs are clean, and until then an rbd backend cannot say its capacity."""
        deadline = time.monotonic() + timeout
        while True:
            pools = json.loads(self.ceph("df", "--format", "json")).get("pools", [])
            if any(p.get("name") == name and p.get("stats", {}).get("max_avail", 0) > 0 for p in pools):
                return
            if time.monotonic() > deadline:
                raise DriverError(f"ceph df did not report the pool {name} within {timeout:g}s")
            time.sleep(0.3)

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def osd_ids(self) -> list[int]:
        """The ids of this cluster's OSDs (running or not)."""
        return sorted(int(p.name.rsplit("-", 1)[1]) for p in (self.root / "osd").glob("ceph-*"))

    def kill_osd(self, osd_id: int) -> int:
        """SIGKILL ``osd.<osd_id>`` (a crash: no clean shutdown), wait until it is gone; its PID."""
        proc = self._procs.pop(self._osd_name(osd_id), None)
        if proc is None:
            raise InvalidParameter(f"osd.{osd_id} is not running")
        proc.send_signal(signal.SIGKILL)
        proc.wait(STOP_TIMEOUT_S)
        return proc.pid

    def start_osd(self, osd_id: int) -> None:
        """Start ``osd.<osd_id>`` again (after ``kill_osd``); ``wait_clean()`` waits until it has rejoined."""
        name = self._osd_name(osd_id)
        if name in self._procs:
            raise InvalidParameter(f"{name} is running")
        self._spawn(name, ["ceph-osd", "--conf", str(self.conf_path), "-f", "-i", str(osd_id)])

    def _osd_name(self, osd_id: int) -> str:
        if isinstance(osd_id, bool) or not isinstance(osd_id, int) or osd_id not in self.osd_ids():
            raise InvalidParameter(f"this cluster has no osd.{osd_id!r}")
        return f"osd.{osd_id}"

    def stop(self) -> None:
        """Stop the OSDs, then the mgr, then the mon, each by its PID; wait until each is gone."""
        rank = {"osd": 0, "mgr": 1, "mon": 2}
        for name in sorted(self._procs, key=lambda n: (rank[n.split(".", 1)[0]], n)):
            stop_child(self._procs.pop(name), timeout=STOP_TIMEOUT_S, what="the Ceph daemon")
        self._procs.clear()

