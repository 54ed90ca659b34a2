"""A cluster of machines in network namespaces on one Linux host (docs/install.md "Trying it in network
namespaces"): each machine a namespace of its own with loopback and one interface ``eth0`` on a bridge,
an address from a private range, and the processes started in it.

The bridge lives in a namespace of its own (the *switch*), not in the host's: nothing of the cluster
touches the host's interfaces, routes or firewall, its range cannot collide with the host's routes, and
the host itself cannot reach the machines (traffic stays between them). Each machine's veth pair is made
from inside the switch (``ip -n SWITCH link add v-NAME type veth peer name eth0 netns MACHINE``), so no
interface ever has a name in the host's namespace, and two clusters with different prefixes run side
by side.

A process runs in a machine as ``ip netns exec NS argv…``: ``ip`` enters the namespace and executes
argv in its own place, so the PID a ``Popen`` returns is the process's, and it is stopped by that PID.
Everything is undone in the reverse order of its making (processes, then the machines' namespaces —
which takes their veth pairs with them — then the switch), also when a step failed half-way: each
undo is registered before its making. A machine's link can be taken down and its address removed (and
put back) for partition tests, and two machines cut from each other alone (``cut``/``mend``): each one's
neighbour entry for the other is pinned to a MAC no interface has, so their frames to each other go
nowhere (the bridge floods them, no port takes them) while everything else flows. That needs nothing but
``ip`` (no nftables, iptables or tc actions, which the machines this was written on lack): the loss is
silent, as on a broken switch port, not an error the sender sees.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from vbs.errors import DriverError, InvalidParameter
from vbs.system.processes import stop_child

__all__ = ["DEFAULT_SUBNET", "GUIDE_MACHINES", "Machine", "NetnsCluster", "existing_namespaces", "remove",
           "wait_listening"]

# A private /24 that none of the machines this was written on routes (the namespaces keep it from the
# host's tables anyway: the bridge is in the switch namespace).
DEFAULT_SUBNET = "10.77.0.0/24"
IP = "ip"
BRIDGE = "br0"
IFACE = "eth0"
# Interface names are at most 15 bytes: "v-" and a machine's name.
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,12}$")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
IP_TIMEOUT_S = 60.0
# A locally administered unicast MAC no machine has: frames sent to it are dropped by every port.
NOWHERE_MAC = "02:00:00:00:0b:ad"
# The machines of docs/install.md, each with its address's last number there (10.0.0.10 is ctl-1; ceph-1
# is the Ceph cluster stor-3's RBD pool is in), and a client machine for the CLI and boto3.
GUIDE_MACHINES = {"db": 5, "ctl-1": 10, "ctl-2": 11, "stor-1": 20, "stor-2": 21, "stor-3": 22, "hv-1": 30,
                  "hv-2": 31, "ceph-1": 50, "client": 40}
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Machine:
    """One machine of the cluster: its name, its namespace and its address on the bridge."""

    name: str
    netns: str
    address: str
    prefix_len: int

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside this machine's namespace."""
        return [IP, "netns", "exec", self.netns, *argv]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (argv, no shell); ``DriverError`` with its output if it fails and ``check``."""
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise DriverError(f"ip {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def existing_namespaces(prefix: str) -> list[str]:
    """The network namespaces whose names start with ``prefix-`` (a cluster left behind: scripts/netns-cluster)."""
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{prefix}-")]


class NetnsCluster:
    """The switch namespace ``PREFIX-switch`` with a bridge, and machines added to it (``add``); a context
    manager that undoes everything it made, last first."""

    def __init__(self, prefix: str, subnet: str = DEFAULT_SUBNET) -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise InvalidParameter(f"a cluster's prefix is 1-16 of a-z 0-9 starting with a letter, not {prefix!r}")
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
        self.switch = f"{prefix}-switch"
        self.machines: dict[str, Machine] = {}
        self.stack = ExitStack()  # the namespaces, the bridge
        self.processes = ExitStack()  # stopped before any namespace goes
        self._namespaces: list[str] = []

    # -- making and undoing ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._add_namespace(self.switch)
            self.stack.callback(ip, "-n", self.switch, "link", "del", BRIDGE, check=False)
            ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            ip("-n", self.switch, "link", "set", BRIDGE, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Undo everything, last made first; then ``DriverError`` if a process was still in a namespace
        (one this cluster did not start, and so could not stop by its PID)."""
        try:
            self.processes.close()
        finally:
            left = {ns: self.pids(ns) for ns in self._namespaces}
            self._namespaces.clear()
            self.stack.close()
        stray = {ns: pids for ns, pids in left.items() if pids}
        if stray:
            raise DriverError(f"processes were left in the cluster's namespaces at its teardown: {stray}")

    def keep(self) -> None:
        """Leave the namespaces and the bridge in place when this object is closed (scripts/netns-cluster
        makes a cluster for a person to use; ``remove`` undoes it)."""
        self.stack.pop_all()
        self._namespaces.clear()

    def _add_namespace(self, name: str) -> None:
        self.stack.callback(self._delete_namespace, name)
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _delete_namespace(self, name: str) -> None:
        ip("netns", "del", name, check=False)

    def add(self, name: str, host: int) -> Machine:
        """Machine ``name`` with the ``host``-th address of the range, its link up on the bridge."""
        if not _NAME_RE.fullmatch(name) or name == "switch" or name in self.machines:
            raise InvalidParameter(f"a machine's name is 1-13 of a-z 0-9 - and new in the cluster, not {name!r}")
        address = str(self.subnet.network_address + host)
        if ipaddress.ip_address(address) not in self.subnet or host in (0, self.subnet.num_addresses - 1):
            raise InvalidParameter(f"{address} is no host address of {self.subnet}")
        machine = Machine(name, f"{self.prefix}-{name}", address, self.subnet.prefixlen)
        self._add_namespace(machine.netns)
        # Deleting the machine's namespace deletes its veth end, and with it the switch's.
        ip("-n", self.switch, "link", "add", self.port(machine), "type", "veth", "peer", "name", IFACE,
           "netns", machine.netns)
        ip("-n", self.switch, "link", "set", self.port(machine), "master", BRIDGE, "up")
        ip("-n", machine.netns, "addr", "add", f"{address}/{machine.prefix_len}", "dev", IFACE)
        ip("-n", machine.netns, "link", "set", IFACE, "up")
        self.machines[name] = machine
        return machine

    @staticmethod
    def port(machine: Machine) -> str:
        """The switch's end of ``machine``'s veth pair."""
        return f"v-{machine.name}"

    # -- processes ----------------------------------------------------------------------------------

    def start(self, machine: Machine, argv: Sequence[str], *, log: Path, env: Mapping[str, str],
              cwd: Path | str = "/", stop_timeout: float = STOP_TIMEOUT_S) -> subprocess.Popen[bytes]:
        """``argv`` in ``machine``, its output appended to ``log``; stopped by its PID (SIGTERM, then
        SIGKILL after ``stop_timeout``) when the cluster is undone, before any namespace goes."""
        with log.open("ab") as out:
            proc = subprocess.Popen(machine.argv(argv), stdin=subprocess.DEVNULL, stdout=out,  # noqa: S603
                                    stderr=subprocess.STDOUT, env=dict(env), cwd=cwd)
        self.processes.callback(stop_child, proc, timeout=stop_timeout, what=f"{argv[0]} in {machine.name}")
        return proc

    def run(self, machine: Machine, argv: Sequence[str], *, env: Mapping[str, str], timeout: float = 300.0,
            cwd: Path | str = "/", input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` in ``machine`` to its end, its output captured (not checked)."""
        return subprocess.run(machine.argv(argv), capture_output=True, text=True, timeout=timeout,  # noqa: S603
                              env=dict(env), cwd=cwd, input=input, check=False)

    @staticmethod
    def pids(netns: str) -> list[int]:
        """The PIDs of the processes in the namespace ``netns`` now."""
        proc = ip("netns", "pids", netns, check=False)
        return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []

    # -- partitions ---------------------------------------------------------------------------------

    def link_down(self, machine: Machine) -> None:
        """Cut ``machine`` from the bridge (its own interface stays up: it sees no carrier loss)."""
        ip("-n", self.switch, "link", "set", self.port(machine), "down")

    def link_up(self, machine: Machine) -> None:
        ip("-n", self.switch, "link", "set", self.port(machine), "up")

    def remove_address(self, machine: Machine) -> None:
        ip("-n", machine.netns, "addr", "del", f"{machine.address}/{machine.prefix_len}", "dev", IFACE)

    def restore_address(self, machine: Machine) -> None:
        ip("-n", machine.netns, "addr", "add", f"{machine.address}/{machine.prefix_len}", "dev", IFACE)

    def cut(self, a: Machine, b: Machine) -> None:
        """Drop every packet between ``a`` and ``b`` (both ways), silently; the rest of their traffic flows.
        Each one's neighbour entry for the other points to ``NOWHERE_MAC`` (permanent: ARP cannot fix it)."""
        for here, there in ((a, b), (b, a)):
            ip("-n", here.netns, "neigh", "replace", there.address, "lladdr", NOWHERE_MAC, "dev", IFACE,
               "nud", "permanent")

    def mend(self, a: Machine, b: Machine) -> None:
        """Undo ``cut``: the pinned entries go, and the next packet finds the real MAC by ARP again."""
        for here, there in ((a, b), (b, a)):
            ip("-n", here.netns, "neigh", "del", there.address, "dev", IFACE, check=False)


def remove(prefix: str) -> list[str]:
    """Delete the namespaces of the cluster ``prefix`` (made and kept by scripts/netns-cluster), the
    machines first, the switch last; refused while a process runs in one of them (stop it by its PID
    first). The names deleted."""
    names = existing_namespaces(prefix)
    busy = {ns: NetnsCluster.pids(ns) for ns in names if NetnsCluster.pids(ns)}
    if busy:
        raise DriverError(f"processes still run in the cluster's namespaces (stop them by PID first): {busy}")
    switch = f"{prefix}-switch"
    for name in sorted(names, key=lambda n: n == switch):
        ip("netns", "del", name)
    return names


def wait_listening(cluster: NetnsCluster, machine: Machine, port: int, timeout: float) -> None:
    """Until something in ``machine`` listens on TCP ``port`` (``ss`` in its namespace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = cluster.run(machine, ["ss", "-Hltn", f"sport = :{port}"], env={"PATH": "/usr/sbin:/usr/bin:/bin"})
        if proc.returncode == 0 and proc.stdout.strip():
            return
        time.sleep(0.2)
    raise DriverError(f"nothing listens on {machine.name}:{port} after {timeout:g} s")
