"""The database handle: engine set-up for SQLite or PostgreSQL, migrations at start, sessions.

SQLite runs in WAL mode. Writing transactions start with ``BEGIN IMMEDIATE`` and queue on a lock
in this process (SQLite's own busy handler sleeps between retries, which makes waits long and
unfair); read-only ones (``read()``) start with a plain ``BEGIN`` and run beside the writer.
synchronous=FULL keeps every commit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).with_name("migrations")
READ_ONLY = "vbs_read_only"


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event decide how transactions start.
        dbapi_connection.isolation_level = None
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")


class Database:
    """One engine and its session factory; ``session()`` is a transaction that commits on success."""

    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite"):
            self.engine = create_engine(
                url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=20, max_overflow=20
            )
            _sqlite_pragmas(self.engine)
        else:
            self.engine = create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self.engine.execution_options(**{READ_ONLY: True}),
                                           expire_on_commit=False)
        self._sqlite = url.startswith("sqlite")
        self._write_lock = threading.RLock()

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> Database:
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{data_dir.resolve() / 'vbs.db'}")

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent)."""
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with self.engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "head")

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A writing transaction: commits on success, rolls back on an exception."""
        if not self._sqlite:
            with self._sessions() as session, session.begin():
                yield session
            return
        with self._write_lock, self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only transaction (on SQLite it does not wait for writers)."""
        with self._read_sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
