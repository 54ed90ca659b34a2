"""An embedded PostgreSQL cluster (Debian's PostgreSQL 15): what ``vbs up --postgres`` and the tests run.

The cluster lives in ``<parent>/postgres/`` (``data/``, and ``run/`` for its unix socket), owned by
the ``postgres`` user (PostgreSQL refuses to run as root) and mode 0700. It listens on its unix
socket only (``listen_addresses=''``), in a directory only ``postgres`` and root may enter, so its
trust authentication reaches nobody else. For ``postgres`` to reach its directory the parent is made
enterable, not readable, by the postgres group alone (0710, group ``postgres``); every ancestor above
must already be enterable by it. Its log goes to ``<parent>/postgres.log`` (root's, 0600).

The postmaster is this process's child, started without a shell and stopped by its PID: SIGINT is
``pg_ctl stop -m fast``, and the stop waits until that PID is gone.

The namespace cluster (src/vbs/rigs/netns.py, docs/install.md "Trying it in network namespaces") runs it
as a database machine of its own: in a network namespace (``ip netns exec NS setpriv …``, which enter
the namespace as root and then become ``postgres``, each executing the next: the PID is still the
postmaster's), listening on that machine's address too, with settings of its own (TLS).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import signal
import stat
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from vbs.errors import DriverError, InvalidParameter
from vbs.system.processes import cmdline, pid_alive, stop_child
from vbs.trust.fail_closed import POSTGRES_CLUSTER_DIR, holds_cluster

__all__ = ["EmbeddedPostgres", "CLUSTER_DIR", "holds_cluster"]

CLUSTER_DIR = POSTGRES_CLUSTER_DIR
OS_USER = "postgres"
DB_USER = "vbs"
SOCKET_PATH_MAX = 107
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_DB_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def pg_bin() -> Path:
    """The bin directory of the newest PostgreSQL installed from Debian's packages."""
    found = sorted((p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "postgres").exists()),
                   key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    if not found:
        raise InvalidParameter("PostgreSQL is not installed (Debian: apt-get install postgresql-15)")
    return found[-1]


class EmbeddedPostgres:
    """One cluster in ``parent/postgres``; ``start()``, ``url(db)``, ``create_database(db)``, ``stop()``."""

    def __init__(self, parent: Path, port: int = 5432, *, listen: str = "", netns: str | None = None,
                 settings: Mapping[str, str] | None = None) -> None:
        self.parent = parent.resolve()
        self.root = self.parent / CLUSTER_DIR
        self.data = self.root / "data"
        self.run = self.root / "run"
        self.log_path = self.parent / "postgres.log"
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.listen, self.netns, self.settings = listen, netns, dict(settings or {})
        account = pwd.getpwnam(OS_USER)
        self._uid, self._gid = account.pw_uid, account.pw_gid
        self._groups = [g.gr_gid for g in grp.getgrall() if OS_USER in g.gr_mem]

    # -- set-up --------------------------------------------------------------------------------

    def _as_postgres(self, argv: list[str], log: int, *, in_netns: bool = False) -> subprocess.Popen[bytes]:
        # No shell, no inherited environment (nothing secret reaches it), the cluster's own directory.
        if in_netns and self.netns is not None:
            # Only root enters a namespace: setpriv becomes postgres after it (its groups with it).
            argv = ["ip", "netns", "exec", self.netns, "setpriv", f"--reuid={OS_USER}", f"--regid={OS_USER}",
                    "--init-groups", "--", *argv]
            return subprocess.Popen(argv, env={"PATH": "/usr/sbin:/usr/bin:/bin", "LANG": "C.UTF-8"},  # noqa: S603
                                    cwd=self.root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return subprocess.Popen(argv, user=self._uid, group=self._gid, extra_groups=self._groups,  # noqa: S603
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=self.root,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def _enterable_by_postgres(self, path: Path) -> bool:
        st = path.stat()
        if st.st_uid == self._uid:
            return bool(st.st_mode & stat.S_IXUSR)
        if st.st_gid == self._gid or st.st_gid in self._groups:
            return bool(st.st_mode & stat.S_IXGRP)
        return bool(st.st_mode & stat.S_IXOTH)

    def prepare(self) -> None:
        """Make the cluster's directories (and the cluster, once); refuse a place postgres cannot reach."""
        socket_path = self.run / f".s.PGSQL.{self.port}"
        if len(str(socket_path)) > SOCKET_PATH_MAX:
            raise InvalidParameter(f"the PostgreSQL socket {socket_path} would be longer than {SOCKET_PATH_MAX} "
                                   "bytes; choose a shorter data directory")
        for ancestor in reversed(self.parent.parents):
            if not self._enterable_by_postgres(ancestor):
                raise InvalidParameter(
                    f"the embedded PostgreSQL cluster goes in {self.root}, but the postgres user cannot enter "
                    f"{ancestor}; choose a data directory whose parents it may enter (e.g. under /var/lib), or run "
                    "PostgreSQL yourself and give --database-url")
        os.chown(self.parent, -1, self._gid)
        self.parent.chmod(0o710)
        for d in (self.root, self.run):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chown(d, self._uid, self._gid)
            d.chmod(0o700)
        if (self.data / "PG_VERSION").exists():
            return
        with self._log() as log:
            proc = self._as_postgres([str(pg_bin() / "initdb"), "-D", str(self.data), "-A", "trust", "-U", DB_USER,
                                      "-E", "UTF8", "--locale=C", "--no-instructions"], log)
            if proc.wait(120) != 0:
                raise DriverError(f"initdb failed (exit {proc.returncode}); see {self.log_path}")

    def _log(self) -> _LogFile:
        return _LogFile(self.log_path)

    # -- running -------------------------------------------------------------------------------

    def start(self) -> None:
        self.prepare()
        self._stop_stale_postmaster()
        with self._log() as log:
            self.proc = self._as_postgres([
                str(pg_bin() / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.run),
                "-c", f"listen_addresses={self.listen}", "-c", "unix_socket_permissions=0700",
                "-c", "max_connections=200", "-c", "fsync=on",
                *(a for k, v in self.settings.items() for a in ("-c", f"{k}={v}"))], log, in_netns=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._accepts_connections():
            if self.proc.poll() is not None:
                raise DriverError(f"PostgreSQL exited during start-up (code {self.proc.returncode}); see "
                                  f"{self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise DriverError(f"PostgreSQL did not accept connections within {START_TIMEOUT_S:g}s; see "
                                  f"{self.log_path}")
            time.sleep(0.1)

    def _accepts_connections(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(host=str(self.run), port=self.port, user=DB_USER, dbname="postgres",
                                 connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def _stop_stale_postmaster(self) -> None:
        """A postmaster a killed ``vbs up`` left running on this data directory: stopped by its PID."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return
        if str(self.data) in " ".join(cmdline(pid)) and pid_alive(pid):
            os.kill(pid, signal.SIGINT)
            _wait_gone(pid, STOP_TIMEOUT_S)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the postmaster's PID, as ``pg_ctl stop -m fast``), then wait until
        that PID is gone; an immediate shutdown (SIGQUIT) if it does not go in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_child(proc, timeout=STOP_TIMEOUT_S, what="the PostgreSQL postmaster", first=signal.SIGINT,
                   last=signal.SIGQUIT)

    # -- databases -----------------------------------------------------------------------------

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` (psycopg 3, over the unix socket, no password)."""
        return (f"postgresql+psycopg://{DB_USER}@/{database}?host={quote(str(self.run), safe='/')}"
                f"&port={self.port}")

    def create_database(self, database: str) -> str:
        """Create ``database`` unless it exists; its URL."""
        import psycopg
        from psycopg import sql

        if not _DB_NAME_RE.fullmatch(database):
            raise InvalidParameter(f"invalid database name {database[:64]!r}")
        with psycopg.connect(host=str(self.run), port=self.port, user=DB_USER, dbname="postgres",
                             autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        return self.url(database)


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise DriverError(f"the PostgreSQL postmaster {pid} did not stop")
        time.sleep(0.05)


class _LogFile:
    """The cluster's log, opened by root (0600) and handed to the postmaster as its stdout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return self.fd

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)
