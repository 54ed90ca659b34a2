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

import psycopg
from psycopg import sql

from vbs.rigs.postgres import DB_USER, EmbeddedPostgres

VBS = [sys.executable, "-m", "vbs"]


class PostgresForTests:
    def __init__(self, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vbs-pg-", dir="/tmp"))
        self.cluster = EmbeddedPostgres(self.dir, port=port)
        self._names = itertools.count(1)
        self._upgraded: str | None = None  # the database that the others are copies of

    def start(self) -> None:
        self.cluster.start()

    def new_database(self) -> str:
        """A new, empty database: its URL."""
        return self.cluster.create_database(f"t{next(self._names)}")

    def upgraded_database(self) -> str:
        """A new database at this VBS's schema: a copy (``CREATE DATABASE … TEMPLATE``) of one that
        ``vbs db upgrade`` brought there, as an operator does, once per session."""
        if self._upgraded is None:
            self._upgraded = f"t{next(self._names)}"
            url = self.cluster.create_database(self._upgraded)
            proc = subprocess.run([*VBS, "db", "upgrade", "--database-url", url], capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr
        name = f"t{next(self._names)}"
        with psycopg.connect(host=str(self.cluster.run), port=self.cluster.port, user=DB_USER, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                           sql.Identifier(self._upgraded)))
        return self.cluster.url(name)

    def stop(self) -> None:
        pid = self.cluster.pid
        self.cluster.stop()
        assert pid is None or not Path(f"/proc/{pid}").exists(), f"postmaster {pid} is still running"
        shutil.rmtree(self.dir, ignore_errors=True)
