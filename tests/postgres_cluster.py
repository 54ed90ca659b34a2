"""A real PostgreSQL 15 cluster for the tests (Debian's), one per test session and xdist worker.

It is ``vbs.rigs.postgres.EmbeddedPostgres`` in a fresh directory under /tmp (the cluster's own directory
owned by ``postgres``), on its unix socket only, with a port number no other cluster here uses.
Each install a test starts gets a database of its own. At the end the postmaster is stopped by its
PID (SIGINT, ``pg_ctl stop -m fast``) and the test checks that the PID is gone.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vbs.rigs.postgres import EmbeddedPostgres

VBS = [sys.executable, "-m", "vbs"]


class PostgresForTests:
    def __init__(self, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vbs-pg-", dir="/tmp"))
        self.cluster = EmbeddedPostgres(self.dir, port=port)
        self._names = itertools.count(1)

    def start(self) -> None:
        self.cluster.start()

    def new_database(self) -> str:
        """A new, empty database: its URL."""
        return self.cluster.create_database(f"t{next(self._names)}")

    def upgraded_database(self) -> str:
        """A new database brought to this VBS's schema by ``vbs db upgrade``, as an operator does."""
        url = self.new_database()
        proc = subprocess.run([*VBS, "db", "upgrade", "--database-url", url], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return url

    def stop(self) -> None:
        pid = self.cluster.pid
        self.cluster.stop()
        assert pid is None or not Path(f"/proc/{pid}").exists(), f"postmaster {pid} is still running"
        shutil.rmtree(self.dir, ignore_errors=True)
