"""Shared fixtures: real VBS processes on free loopback ports in temporary directories.

Every process a test starts is stopped by its PID at teardown; nothing is killed by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ceph_cluster import CephForTests, RadosGatewayForTests
from tests.installed import FIRST_RELEASE, Installed, install
from tests.loopfs import loop_filesystem
from tests.postgres_cluster import PostgresForTests
from vbs.controller.db import Database
from vbs.net.api_client import CONNECTION_LIMITS
from vbs.net.ports import free_port
from vbs.system.processes import stop_children
from vbs.trust import credentials
from vbs.trust.credentials import AccessKey
from vbs.trust.node_credentials import NodeKeyring

VBS = [sys.executable, "-m", "vbs"]


def node_token(data_dir: Path, kind: str, name: str) -> str:
    """The token of node ``name`` of the install whose controller keeps ``data_dir``."""
    return NodeKeyring.for_data_dir(data_dir).ensure().token(kind, name)


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP socket listening on ``port`` (from /proc: not another's)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:["):-1] for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    except OSError:
        return False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                    return True
    return False


def free_ports(n: int) -> int:
    """A port P with P .. P+n-1 all free now (``vbs up --controllers N`` uses consecutive ports)."""
    for _ in range(200):
        base = free_port()
        if base + n - 1 > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base + 1, base + n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def empty_file(path: Path, size: int) -> Path:
    """A sparse file of ``size`` bytes at ``path``: a volume or a snapshot target for a driver's tests."""
    with path.open("wb") as f:
        f.truncate(size)
    return path


def detached_after(request: pytest.FixtureRequest, vm: str, set_up_first: tuple[str, ...] = ()) -> Iterator[None]:
    """The body of a module's autouse fixture: after each test that uses the module's ``driver`` fixture (a
    hypervisor driver), force-detach every disk it still lists in ``vm``, so that a test that failed before
    its detach leaves the module's shared guest as the next test expects. ``set_up_first``: fixtures the
    test may use (its exports) that must be torn down after this, hence set up before it."""
    if "driver" not in request.fixturenames:
        yield
        return
    for name in set_up_first:
        if name in request.fixturenames:
            request.getfixturevalue(name)
    yield
    driver = request.getfixturevalue("driver")
    for disk in driver.list_disks(vm):
        driver.detach(vm, disk.serial, force=True)


def wait_until(check: Any, timeout: float = 30.0, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_bare_vm(vm: subprocess.Popen[bytes]) -> None:
    """Stop a ``start_bare_vm`` QEMU: it has no guest to flush for, so SIGKILL. (On SIGTERM QEMU drains
    its disks first, and one whose NBD export went away waits out the reconnect delay, 15 s.)"""
    stop_process(vm, signal.SIGKILL)


def reap_daemons(state_dir: Path) -> None:
    """Stop export daemons an agent killed with SIGKILL left behind, by the PID in their pidfiles.

    Only a process whose command line names this state directory is signalled (no PID-reuse accidents).
    """
    for pidfile in state_dir.rglob("*.pid"):
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if str(state_dir).encode() in cmdline:
            os.kill(pid, signal.SIGKILL)


class Vbs:
    """A running VBS install: its endpoint, data dir, and helpers to drive it by REST and CLI."""

    def __init__(self, endpoint: str, data_dir: Path, key: AccessKey | None = None) -> None:
        self.endpoint = endpoint
        self.data_dir = data_dir
        self.key = key or credentials.read(data_dir / "credentials", "default")[0]
        # The product's client limits: an idle connection is not reused as the server closes it.
        self.http = httpx.Client(base_url=endpoint, timeout=30, limits=CONNECTION_LIMITS,
                                 headers={"authorization": f"Bearer {self.key.bearer}"})

    @property
    def pool(self) -> Path:
        return self.data_dir / "pool"

    def cli(self, *args: str, check: bool = True) -> Any:
        """Run ``vbs -o json ARGS`` and return the parsed JSON (or the process if it failed)."""
        env = {**os.environ, "VBS_ENDPOINT": self.endpoint, "VBS_ACCESS_KEY_ID": self.key.access_key_id,
               "VBS_SECRET_ACCESS_KEY": self.key.secret_access_key}
        proc = subprocess.run([*VBS, "-o", "json", *args], env=env, capture_output=True, text=True, timeout=120)
        if check:
            assert proc.returncode == 0, f"vbs {' '.join(args)} failed: {proc.stderr}"
            return json.loads(proc.stdout) if proc.stdout.strip() else None
        return proc

    def volume(self, volume_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/volumes/{volume_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def snapshot(self, snapshot_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/snapshots/{snapshot_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def wait_volume(self, volume_id: str, status: str, timeout: float = 60) -> dict[str, Any]:
        return wait_until(lambda: (v := self.volume(volume_id))["status"] == status and v, timeout,
                          what=f"{volume_id} {status}")

    def wait_snapshot(self, snapshot_id: str, status: str, timeout: float = 60) -> dict[str, Any]:
        return wait_until(lambda: (s := self.snapshot(snapshot_id))["status"] == status and s, timeout,
                          what=f"{snapshot_id} {status}")

    def snapshot_data(self, snapshot_id: str) -> Path:
        """A file holding the snapshot's data: its pool copy where its pool keeps one (reflink), else a
        volume made from it (hydrated from the snapshot store: a copy pool gives its copy up once the
        snapshot is stored)."""
        copy = self.pool / "snapshots" / f"{snapshot_id}.raw"
        if copy.exists():
            return copy
        r = self.http.post("/v1/volumes", json={"snapshot_id": snapshot_id})
        assert r.status_code == 200, r.text
        made = self.wait_volume(r.json()["volume_id"], "available", timeout=300)
        return self.pool / "volumes" / f"{made['volume_id']}.raw"

    def create_volume(self, **body: Any) -> dict[str, Any]:
        r = self.http.post("/v1/volumes", json=body)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def ec2(self, key_id: str | None = None, secret: str | None = None) -> Any:
        """A boto3 EC2 client of this install (its key, or the one given), without retries."""
        return self.aws("ec2", key_id, secret)

    def aws(self, service: str, key_id: str | None = None, secret: str | None = None) -> Any:
        """A boto3 client of AWS's ``service`` (ec2, dlm, ...) on this install's endpoint, without retries."""
        import boto3
        from botocore.config import Config

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key_id or self.key.access_key_id,
                            aws_secret_access_key=secret or self.key.secret_access_key,
                            config=Config(retries={"max_attempts": 1}))

    def instance(self, vm_id: str, timeout: float = 60) -> str:
        """The instance id of the running VM ``vm_id``, once a host agent reported it."""
        def find() -> str | None:
            for i in self.http.get("/v1/instances").json()["instances"]:
                if i["vm_id"] == vm_id and i["state"] == "running":
                    return str(i["instance_id"])
            return None
        return str(wait_until(find, timeout, what=f"instance {vm_id}"))

    def all_volumes(self) -> list[dict[str, Any]]:
        """Every volume this key sees, page after page (a describe answers at most 1,000)."""
        found: list[dict[str, Any]] = []
        params: dict[str, str] = {"max_results": "1000"}
        while True:
            body = self.http.get("/v1/volumes", params=params).json()
            found += body["volumes"]
            if not body.get("next_token"):
                return found
            params["next_token"] = body["next_token"]


# The ``vbs up`` installs running now: a failing test's report ends with what their logs said last.
RUNNING_UPS: list[VbsUp] = []
LOG_TAIL_LINES = 40


class VbsUp:
    """``vbs up`` as a child process, started and stopped by the test."""

    def __init__(self, data_dir: Path, log: Path, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, ports: int = 1) -> None:
        self.ports = ports
        self.port = free_ports(ports)  # vbs up --controllers N takes this port and the N-1 after it
        self.data_dir = data_dir
        self.log_path = log
        self.extra = extra or []
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.came_up = False  # once up, a restart keeps its port: the test's clients hold its URL

    def start(self, timeout: float = 90) -> Vbs:
        # The port was free when it was chosen, not reserved: another worker's daemon may have bound it
        # since (seen in a fresh clone's make test: "port … is in use", at the module's fixture). vbs up
        # checks its ports before it starts anything, so a first start takes other ports and tries again.
        for _ in range(3):
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._spawn()
            # A restart appends to the same log: look at what this start wrote.
            wait_until(lambda at=offset: b"VBS is up" in self.log_path.read_bytes()[at:] or self._died(), timeout,
                       what="vbs up")
            said = self.log_path.read_bytes()[offset:]
            # Any of the ports it takes (--controllers N: this one and the N-1 after it).
            if self._died() and not self.came_up and b"is in use" in said and b"give another --port" in said:
                self.port = free_ports(self.ports)
                continue
            break
        assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()[-3000:]
        self.came_up = True
        return Vbs(f"http://127.0.0.1:{self.port}", self.data_dir)

    def _spawn(self) -> None:
        # XDG_CONFIG_HOME: vbs up records its endpoint's key there; keep that inside the test's tree.
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.data_dir.parent / "xdg"), **self.env}
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([*VBS, "up", "--data-dir", str(self.data_dir), "--port", str(self.port),
                                          *self.extra], stdout=log, stderr=subprocess.STDOUT, env=env)
        if self not in RUNNING_UPS:
            RUNNING_UPS.append(self)

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def child_pid(self, role: str) -> int | None:
        """The PID of this vbs up's child ``role`` (controller, storage-agent, host-agent), if running."""
        assert self.proc is not None
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            if int(fields[1]) == self.proc.pid and role.encode() in cmdline and fields[0] != "Z":
                return int(stat.parent.name)
        return None

    def stop(self) -> None:
        if self in RUNNING_UPS:
            RUNNING_UPS.remove(self)
        if self.proc is not None:
            stop_process(self.proc, signal.SIGINT)
        reap_daemons(self.data_dir / "storage-state")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log, and before them its last warnings and errors: the lines
        that say why a workflow failed are rarely the very last ones."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        tail = text[-lines:]
        alarms = [line for line in text[:-lines] if " WARNING " in line or " ERROR " in line][-lines:]
        return "\n".join([*alarms, "[...]", *tail] if alarms else tail)


@contextmanager
def running_vbs_up(tmp: Path, *extra: str) -> Iterator[Vbs]:
    """``vbs up EXTRA`` with its data in ``tmp/var`` and its log in ``tmp/vbs-up.log``, stopped after."""
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=list(extra))
    try:
        yield up.start()
    finally:
        up.stop()


class GuestOfVbsUp:
    """A ``vbs up`` (``vbs``) and its booted guest vm1 (``guest``): volumes attached and detached as a user
    does (REST), waiting until the guest sees each disk come or go."""

    vbs: Vbs
    guest: Any

    def attach(self, vol: str, device: str = "vdb") -> str:
        """Attach ``vol`` to vm1; the guest's name for the disk."""
        from vbs.ids import virtio_serial

        r = self.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": self.vbs.instance("vm1"),
                                                                  "device": device})
        assert r.status_code == 200, r.text
        wait_until(lambda: [a["state"] for a in self.vbs.volume(vol)["attachments"]] == ["attached"], 60,
                   what=f"{vol} attached")
        return str(self.guest.wait_for_disk(virtio_serial(vol), 30))

    def detach(self, vol: str) -> None:
        from vbs.ids import virtio_serial

        r = self.vbs.http.post(f"/v1/volumes/{vol}/detach", json={})
        assert r.status_code == 200, r.text
        self.vbs.wait_volume(vol, "available")
        self.guest.wait_disk_gone(virtio_serial(vol), 30)


@contextmanager
def vbs_up_with_guest(tmp: Path, vm: str = "vm1", env: dict[str, str] | None = None,
                      **machine: Any) -> Iterator[tuple[Vbs, VbsUp, Any]]:
    """``vbs up`` in ``tmp/var`` (with ``env`` in its environment) and a booted test guest ``vm`` that its
    host agent finds (QEMU, TCG); ``machine``: TestGuest's machine options (``machine="q35", root_ports=1``)."""
    from vbs.rigs.testguest import TestGuest, build_guest

    up = VbsUp(tmp / "var", tmp / "up.log", env=env)
    guest = TestGuest(vm, tmp / "guests", build_guest(), tmp / "var" / "vms", **machine)
    try:
        guest.start()  # boots while vbs up starts
        vbs = up.start()
        guest.wait_ready(120)
        yield vbs, up, guest
    finally:
        guest.stop()
        up.stop()


# The metadata databases a module runs on when it asks for both:
#   pytestmark = pytest.mark.parametrize("metadata_db", DATABASES, indirect=True, scope="module")
# Combinations of a parametrized test that the default run (make test) leaves to make torture, to stay
# within its time budget. Each has a sibling in the default run that takes the same path with the other
# transport or database: every victim of the kill matrix is killed once (nbd or iscsi), every test on
# PostgreSQL keeps its sqlite twin and the chains and moves keep their nbd half.
TORTURE_ONLY = frozenset({
    "tests/test_data_integrity.py::test_checksums_survive_a_killed_service_while_the_guest_writes[nbd-storage-agent]",
    "tests/test_data_integrity.py::test_checksums_survive_a_killed_service_while_the_guest_writes[nbd-host-agent]",
    "tests/test_data_integrity.py::test_checksums_survive_a_killed_service_while_the_guest_writes[iscsi-export-daemon]",
    "tests/test_data_integrity.py::test_checksums_survive_a_killed_service_while_the_guest_writes[iscsi-controller]",
    "tests/test_data_integrity.py::test_snapshot_clone_chains_preserve_every_link_and_clones_are_independent[iscsi]",
    "tests/test_data_integrity.py::test_a_volume_moved_between_guests_keeps_its_data_both_ways[iscsi]",
    "tests/test_concurrency.py::test_fifty_clients_at_once_leave_only_legal_outcomes[postgresql]",
    "tests/test_concurrency.py::test_forced_detach_finishes_when_the_export_is_already_gone[postgresql]",
    "tests/test_concurrency.py::test_forced_detach_finishes_when_the_export_is_already_gone[postgresql-2]",
    "tests/test_ec2_api.py::test_the_aws_cli_drives_every_action[postgresql]",
    "tests/test_command_e2e.py::test_a_guest_that_never_releases_the_disk_makes_detach_busy[iscsi]",
    "tests/test_api_snapshots.py::test_deleting_a_snapshot_that_a_creating_volume_copies_is_refused[postgresql]",
})


# The longest modules of make test (about 90 s of work or more each, measured with --durations=0), longest
# first: they run first, so that the two workers (``-n 2 --dist loadfile --no-loadscope-reorder``) end
# together on short modules instead of one waiting for the other's long last one. Only an order: a module
# missing here, or a new one, runs after these in collection order.
LONGEST_MODULES = (
    # The lifecycle policies and runs wait for minutes of schedule, mostly asleep: first, beside the busy modules
    # (make test runs them in a pytest of their own beside the rest: scripts/run-tests).
    "test_lifecycle_policies.py", "test_lifecycle_runs.py",
    "test_hostile_input.py", "test_data_integrity.py", "test_command_e2e.py", "test_crash_recovery.py",
    "test_concurrency.py", "test_api_snapshots.py", "test_rbd_crash.py", "test_rbd_chains.py", "test_api_volumes.py",
    "test_libvirt_e2e.py", "test_snapshot_store_e2e.py", "test_torture.py", "test_attach_e2e.py", "test_ec2_api.py",
    "test_encryption.py", "test_vanished_targets.py", "test_rbd_attach_crash.py", "test_rbd_up.py",
    "test_controller_failover.py", "test_rbd_native.py", "test_disaster.py", "test_netns_cluster.py",
    "test_netns_partitions.py",
    "test_install.py", "test_rolling_upgrade.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the TORTURE_ONLY combinations before ``-m 'not torture'`` deselects by marker; put the longest
    modules first (LONGEST_MODULES), each module's tests in their own order."""
    for item in items:
        if item.nodeid in TORTURE_ONLY:
            item.add_marker(pytest.mark.torture)
    rank = {name: k for k, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failing test's report gets the tail of every running ``vbs up`` log (CI keeps the output only)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for up in RUNNING_UPS:
            report.sections.append((f"vbs up log {up.log_path} (tail)", up.log_tail()))


DATABASES = ("sqlite", "postgresql")
# The same for tests of the unit tier: the PostgreSQL half needs root and a daemon, so it is integration.
UNIT_DATABASES = ("sqlite", pytest.param("postgresql", marks=pytest.mark.integration))


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresForTests]:
    """A real PostgreSQL cluster for this session (started only when a test asks for it)."""
    pg = PostgresForTests(free_port())
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture(scope="session")
def installed() -> Iterator[Installed]:
    """This tree's wheel installed as docs/install.md says (tests/installed.py): built once per session, in
    a directory every user may enter and read (mkdtemp in /var/tmp, 0755; pytest's temp dirs are root's
    alone), as the namespace cluster's controllers run it as the guide's user ``vbs``; removed at the
    session's end."""
    root = Path(tempfile.mkdtemp(prefix="vbs-install-", dir="/var/tmp"))
    try:
        root.chmod(0o755)
        yield install(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def installed_first_release(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The first release, 0.1.0, built from its commit in this repository's history and installed the same way."""
    return install(tmp_path_factory.mktemp("install-0.1.0"), FIRST_RELEASE)


@pytest.fixture(scope="session")
def ceph() -> Iterator[CephForTests]:
    """A real single-node Ceph cluster for this session (started only when a test asks for it)."""
    cluster = CephForTests()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def radosgw(ceph: CephForTests) -> Iterator[RadosGatewayForTests]:
    """A RADOS Gateway (S3) on the session's Ceph cluster and an S3 user of it (started only when a test
    asks for it); stopped by its PID before the cluster."""
    gateway = RadosGatewayForTests(ceph)
    try:
        gateway.start()
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def metadata_db(request: pytest.FixtureRequest) -> str:
    """The metadata DB of the installs a test starts: "sqlite" unless its module parametrises it."""
    return str(getattr(request, "param", "sqlite"))


def database_flags(kind: str, request: pytest.FixtureRequest) -> list[str]:
    """``vbs up`` flags for ``kind``: none for SQLite; for PostgreSQL a new database of the session's
    cluster, upgraded by ``vbs db upgrade``."""
    if kind == "sqlite":
        return []
    pg: PostgresForTests = request.getfixturevalue("postgres")
    return ["--database-url", pg.upgraded_database()]


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite metadata DB at this VBS's schema, migrated once per run: each test gets a copy."""
    where = tmp_path_factory.mktemp("migrated-sqlite")
    db = Database.for_data_dir(where)
    db.migrate()
    db.dispose()
    return where / "vbs.db"


def fresh_database(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    """An empty metadata DB at this VBS's schema: SQLite in ``tmp_path`` (a copy of one migrated once),
    or a new PostgreSQL database."""
    if kind == "sqlite":
        tmp_path.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), tmp_path / "vbs.db")
        db = Database.for_data_dir(tmp_path)
    else:
        db = Database(request.getfixturevalue("postgres").new_database())
    db.migrate()  # a no-op on the copy: its schema is at the newest revision already
    request.addfinalizer(db.dispose)
    return db


@pytest.fixture
def vbs_up(tmp_path: Path, metadata_db: str, request: pytest.FixtureRequest) -> Iterator[Vbs]:
    """A fresh embedded install (controller + storage agent) on the ext4 root: the copy path."""
    with running_vbs_up(tmp_path, *database_flags(metadata_db, request)) as vbs:
        yield vbs


@pytest.fixture
def xfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a real XFS (reflink=1) made on a loop device for this test."""
    with loop_filesystem(tmp_path, "xfs", size_mib=8192) as mnt:
        yield mnt


class Services:
    """Controller and storage agent as separate processes (no supervisor), for crash tests."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.data_dir = tmp / "var"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "pool").mkdir(exist_ok=True)
        self.port = free_port()
        self.agent_port = free_port()
        self.nbd_port = free_port()
        self.key = credentials.generate()
        self.agent_token = node_token(self.data_dir, "storage", "storage-1")
        # NBD over plain TCP, which the storage agent allows only --insecure: the world checks of
        # these tests list exports as any client on loopback would.
        self.env = {**os.environ, "VBS_ACCESS_KEY_ID": self.key.access_key_id,
                    "VBS_SECRET_ACCESS_KEY": self.key.secret_access_key, "VBS_STORAGE_AGENT_INSECURE": "true"}
        self.controller: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.host_agent: subprocess.Popen[bytes] | None = None
        self.host_agents: list[subprocess.Popen[bytes]] = []  # every one started (host_agent: the last)
        self.host_names: dict[str, subprocess.Popen[bytes]] = {}  # node name -> its host agent, last started
        self.vbs = Vbs(f"http://127.0.0.1:{self.port}", self.data_dir, self.key)

    def node_env(self, kind: str, name: str) -> dict[str, str]:
        """The environment of one agent: the test's, plus that node's own token."""
        return {**self.env, "VBS_AGENT_TOKEN": node_token(self.data_dir, kind, name)}

    def _log(self, name: str) -> Any:
        return (self.tmp / f"{name}.log").open("ab")

    def start_controller(self, *extra: str, **env: str) -> None:
        """The controller (``extra``: more flags, e.g. a database URL; ``env``: e.g. ``VBS_CRASH_AT``). A port
        that another test's process took since free_port() (parallel workers) would answer /health too, with
        another install's keys: the socket must be this process's. On a first start (no agent points at the
        port yet) it is started again on another port."""
        for _ in range(3):
            self.controller = subprocess.Popen(
                [*VBS, "controller", "--port", str(self.port), "--data-dir", str(self.data_dir), *extra],
                env={**self.env, **env}, stdout=self._log("controller"), stderr=subprocess.STDOUT)
            wait_until(lambda proc=self.controller: proc.poll() is not None or listens(proc.pid, self.port), 60,
                       what="controller listening")
            if self.controller.poll() is None:
                break
            if "VBS_CRASH_AT" in env and self.controller.returncode == -signal.SIGKILL:
                return  # it reached its crash point already (in its recovery): wait_controller_killed sees it
            if self.agent is not None or self.host_agents:
                raise AssertionError(f"the controller could not listen on {self.port} again (see controller.log)")
            self.port = free_port()
            self.vbs = Vbs(f"http://127.0.0.1:{self.port}", self.data_dir, self.key)
        wait_until(lambda: self.vbs.http.get("/health").status_code == 200, 60, what="controller")

    def restart_controller(self, **env: str) -> None:
        """Stop the controller by its PID and start it again (``env``: e.g. ``VBS_CRASH_AT``)."""
        assert self.controller is not None
        stop_process(self.controller)
        self.start_controller(**env)
        if self.controller.poll() is not None:
            return
        # Placement and attach take only nodes whose last report is recent: a request sent before an agent
        # has reported to this controller could be refused (503) on a loaded machine, not crashed (the
        # controller was down long enough for the agents' last reports to age).
        if self.agent is not None:
            self.wait_storage_node_up()
        for name, proc in self.host_names.items():
            if proc.poll() is None:
                self.wait_host_up(name)

    def wait_host_up(self, name: str) -> None:
        wait_until(lambda: any(h["name"] == name and h["state"] == "up" for h in
                               self.vbs.http.get("/v1/hosts").json()["hosts"]), 60, what=f"host agent {name}")

    def wait_storage_node_up(self) -> None:
        wait_until(lambda: any(n["state"] == "up" for n in
                               self.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]), 60, what="agent")

    def wait_controller_killed(self) -> None:
        """Until the controller armed with ``VBS_CRASH_AT`` has SIGKILLed itself at its crash point."""
        assert self.controller is not None
        try:
            self.controller.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the controller did not reach its crash point within 60 s") from None
        assert self.controller.returncode == -signal.SIGKILL, f"controller exited with {self.controller.returncode}"

    def start_agent(self, *extra: str) -> None:
        """The storage agent (``extra``: more flags, e.g. another backend's)."""
        for _ in range(3):
            self.agent = subprocess.Popen(
                [*VBS, "storage-agent", "--port", str(self.agent_port), "--pool-path", str(self.data_dir / "pool"),
                 "--controller-url", self.vbs.endpoint, "--state-dir", str(self.data_dir / "storage-state"),
                 "--nbd-port", str(self.nbd_port), *extra],
                env=self.node_env("storage", "storage-1"), stdout=self._log("agent"), stderr=subprocess.STDOUT)
            # A restarted agent's predecessor may still look "up": wait for this one to listen. A port that
            # another test's daemon took since free_port() (parallel workers) would answer /health too: the
            # socket must be this process's, else it is started again on other ports.
            wait_until(lambda agent=self.agent: agent.poll() is not None or listens(agent.pid, self.agent_port), 60,
                       what="agent listening")
            if self.agent.poll() is None:
                break
            self.agent_port, self.nbd_port = free_port(), free_port()
        self.wait_storage_node_up()

    def start_host_agent(self, name: str = "host-1", config: Path | None = None) -> Path:
        """A host agent whose VMs are QMP sockets in the returned directory (``config``: a vbs.toml)."""
        vm_dir = self.tmp / f"vms-{name}"
        vm_dir.mkdir(exist_ok=True)
        env = {**self.node_env("host", name), **({"VBS_CONFIG": str(config)} if config else {})}
        self.host_agent = subprocess.Popen(
            [*VBS, "host-agent", "--node-name", name, "--port", str(free_port()), "--controller-url",
             self.vbs.endpoint, "--vm-dir", str(vm_dir)],
            env=env, stdout=self._log(name), stderr=subprocess.STDOUT)
        self.host_agents.append(self.host_agent)
        self.host_names[name] = self.host_agent
        self.wait_host_up(name)
        return vm_dir

    def stop(self) -> None:
        # host_agent too: a subclass that starts its own (tests/test_torture.py) sets only that one.
        host_agents = [*self.host_agents, *([self.host_agent] if self.host_agent not in self.host_agents else [])]
        # Together: each takes a moment to end its daemons.
        stop_children([p for p in (*host_agents, self.agent) if p is not None], timeout=20.0)
        if self.controller is not None:
            stop_process(self.controller)
        reap_daemons(self.data_dir / "storage-state")


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    svc = Services(tmp_path)
    try:
        yield svc
    finally:
        svc.stop()


def private_qmp(vm_dir: Path, name: str) -> Path:
    """The second QMP monitor of a VM a test starts, which only the test talks to: the host agent holds
    the first one (``<vm_dir>/<name>.qmp``) with a persistent connection, and QEMU serves one client
    per monitor."""
    return vm_dir.parent / f"{name}.test.qmp"


def start_bare_vm(vm_dir: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    """A QEMU with no guest OS: takes hot-plugged disks, never acknowledges an unplug. Its test
    monitor is ``private_qmp(vm_dir, name)``."""
    return subprocess.Popen(["qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-m", "64", "-nodefaults",
                             "-display", "none", "-qmp", f"unix:{vm_dir / (name + '.qmp')},server=on,wait=off",
                             "-qmp", f"unix:{private_qmp(vm_dir, name)},server=on,wait=off"],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"))


@pytest.fixture(scope="module")
def libvirtd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real libvirtd for a module's tests (tests/libvirtd.py: one at a time on the machine)."""
    from tests.libvirtd import Libvirtd

    daemon = Libvirtd(tmp_path_factory.mktemp("libvirtd"))
    try:
        yield daemon.setup()
    finally:
        daemon.teardown()  # also after a failed setup: it undoes exactly what was done
