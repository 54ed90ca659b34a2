"""The database handle: engine set-up for SQLite or PostgreSQL, the schema's revision, sessions.

SQLite is the embedded default and serves exactly one controller: ``claim()`` holds an exclusive
``flock`` on ``<db>.lock`` for the controller's lifetime, so a second one on the same file is refused
with a clear error instead of two writers each thinking they own the workflows. PostgreSQL serves
several controllers at once; each claims its own id (an advisory lock), and their operations carry
leases by the database's clock (``clock()``) and fences (``next_fence()``). SQLite runs in WAL
mode; writing transactions start with ``BEGIN IMMEDIATE`` and queue on a lock in this process
(SQLite's own busy handler sleeps between retries, which makes waits long and unfair); read-only
ones (``read()``) start with a plain ``BEGIN`` and run beside the writer. synchronous=FULL keeps
every commit.

PostgreSQL (``postgresql+psycopg://…``) runs at READ COMMITTED: code that checks one row and then
writes another locks first (``vbs.controller.db.locks``). Its schema is upgraded only by
``vbs db upgrade``; a controller whose schema is behind (or ahead) refuses to start
(``check_schema``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DataError, DBAPIError, OperationalError, StatementError
from sqlalchemy.orm import Session, sessionmaker

from vbs.controller.db.documents import decode_json
from vbs.errors import AgentUnavailable, IncorrectState, InvalidParameter, RetryLater

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")
READ_ONLY = "vbs_read_only"
# Two `vbs db upgrade` at once on one PostgreSQL database take turns on this advisory lock.
MIGRATION_LOCK = 0x7662_735F_6462  # "vbs_db"
# Controllers on one PostgreSQL database each hold a session advisory lock keyed by their id (this
# namespace, then the id's hash) for their lifetime: two live controllers cannot share an id.
CONTROLLER_LOCK_NAMESPACE = 0x7662_735F  # "vbs_"


class DatabaseInUse(IncorrectState):
    """Another controller (or ``vbs db upgrade``) holds this SQLite database."""

    code = "DatabaseInUse"


class SchemaMismatch(IncorrectState):
    """The database's schema is not the one this controller was built for."""

    code = "SchemaMismatch"


class DatabaseUnavailable(AgentUnavailable):
    """The database server cannot be reached (or refused the connection)."""

    code = "DatabaseUnavailable"


class DatabaseFull(RetryLater):
    """The metadata database's disk is full: the transaction was rolled back and changed nothing; what
    was committed before stays. Writes succeed again once space is freed (docs/operations.md "A full
    metadata disk")."""

    code = "DatabaseFull"


def redact(url: str) -> str:
    """``url`` fit for a log line or an error message: its password, if any, replaced by ``***``."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<an unreadable database URL>"


def has_password(url: str) -> bool:
    try:
        return make_url(url).password is not None
    except ArgumentError:
        return False


# PostgreSQL: a statement that waits this long for a lock, or runs this long, is cancelled (and the
# request answered 503 RetryLater), instead of holding a connection and its locks without end.
LOCK_TIMEOUT_MS = 10_000
STATEMENT_TIMEOUT_MS = 60_000
# PostgreSQL: a link to the database that goes silent (a partition drops packets, nothing resets the
# connection) is given up after this long by both ends, well within an operation lease (15 s): data
# unacknowledged for DEAD_LINK_MS (TCP_USER_TIMEOUT), or no answer to keepalive probes sent after 4 s
# idle, every 2 s, 3 times; a connection attempt after CONNECT_TIMEOUT_S. Without them a controller cut
# from the database waits on TCP's own retransmissions (about 15 minutes) and PostgreSQL keeps the cut
# controller's open transaction, and its row locks, as long (docs/reliability.md "Partitions").
DEAD_LINK_MS = 10_000
CONNECT_TIMEOUT_S = 10
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 4, "keepalives_interval": 2, "keepalives_count": 3,
               "tcp_user_timeout": DEAD_LINK_MS, "connect_timeout": CONNECT_TIMEOUT_S}
_SERVER_SIDE = (f"-c tcp_keepalives_idle=4 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3 "
                f"-c tcp_user_timeout={DEAD_LINK_MS}")
# SQLSTATEs that mean "the same request would succeed if tried again".
_TRANSIENT = {"40P01": "a deadlock", "40001": "a serialisation conflict", "55P03": "a lock wait timeout",
              "57014": "a statement timeout"}


def _unreachable(exc: DBAPIError, read: bool) -> bool:
    """Whether ``exc`` says the database could not be reached, with nothing changed: no connection could
    be made (nothing was sent), or a read's connection was lost (a write's may have been lost on its
    commit, which may have happened)."""
    if type(exc.orig).__name__ == "ConnectionTimeout":  # psycopg's: the connection was never made
        return True
    return read and isinstance(exc, OperationalError) and getattr(exc.orig, "sqlstate", None) is None


@contextmanager
def _transient_conflicts(read: bool = False) -> Iterator[None]:
    """A deadlock, serialisation failure or timeout PostgreSQL detects rolls the transaction back: the
    request is answered 503 RetryLater (nothing changed; the SDKs retry), not 500. So is a database
    that cannot be reached (a controller cut from it: the client goes on to another controller)."""
    try:
        yield
    except DBAPIError as exc:
        state = getattr(exc.orig, "sqlstate", None)
        if _unreachable(exc, read):
            log.warning("database unreachable: %s", str(exc.orig).strip()[:200])
            raise RetryLater("The metadata database did not answer this controller; the request changed "
                             "nothing. Try again, or another controller.") from None
        if state not in _TRANSIENT:
            raise
        log.warning("database: %s (SQLSTATE %s); the transaction was rolled back", _TRANSIENT[state], state)
        raise RetryLater(f"The request met {_TRANSIENT[state]} in the metadata database and changed nothing; "
                         "try again.") from None


# SQLite's SQLITE_FULL ("database or disk is full"); PostgreSQL's disk_full.
_SQLITE_FULL = 13
_DISK_FULL_STATE = "53100"


def is_disk_full(exc: BaseException) -> bool:
    """Whether a database error says its disk is full."""
    orig = getattr(exc, "orig", None)
    if getattr(orig, "sqlite_errorcode", None) == _SQLITE_FULL or getattr(orig, "sqlstate", None) == _DISK_FULL_STATE:
        return True
    return isinstance(exc, OperationalError) and "database or disk is full" in str(orig or exc)


@contextmanager
def _disk_full() -> Iterator[None]:
    """A write the database's full disk refused: the transaction is rolled back, nothing it did is kept;
    answer 503 ``DatabaseFull`` (clients retry), never a 500."""
    try:
        yield
    except DBAPIError as exc:
        if not is_disk_full(exc):
            raise
        reason = str(exc.orig or exc).strip().splitlines()[0][:200]
        log.error("database: its disk is full (%s); the transaction was rolled back", reason)
        raise DatabaseFull("The metadata database's disk is full: the request changed nothing. Try again once "
                           "the operator has freed space.") from None


@contextmanager
def _refused_values() -> Iterator[None]:
    """A value PostgreSQL cannot take (a NUL character in text, which SQLite stores) reaches it only from
    a request the edge let through: answer ``InvalidParameterValue``, as for any other bad value, not
    an internal error. The statement's parameters are not repeated (they are the caller's data)."""
    try:
        yield
    except (UnicodeEncodeError, StatementError) as exc:
        # DataError: PostgreSQL's refusal. UnicodeEncodeError (bare, or wrapped by SQLAlchemy): a lone
        # surrogate that some path let through to a statement; no database can hold one.
        orig = exc.orig if isinstance(exc, StatementError) else exc
        if isinstance(exc, DataError):
            reason = str(orig or "").strip().splitlines()[0][:200] if orig else "invalid value"
        elif isinstance(orig, UnicodeEncodeError):
            reason = "it is not valid Unicode text"
        else:
            raise
        log.warning("database refused a value: %s", reason)
        raise InvalidParameter(f"A value in the request cannot be stored or compared: {reason}.") from None


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


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


class Database:
    """One engine and its session factory; ``session()`` is a transaction that commits on success."""

    def __init__(self, url: str) -> None:
        try:
            parsed = make_url(url)
        except ArgumentError:
            raise InvalidParameter(f"the database URL is not valid: {redact(url)}") from None
        self.url = url
        self.dialect = parsed.get_backend_name()
        if self.dialect not in ("sqlite", "postgresql"):
            raise InvalidParameter(f"unsupported database {redact(url)}: SQLite or PostgreSQL "
                                   "(postgresql+psycopg://…)")
        self.sqlite_path: Path | None = None
        if self.dialect == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                self.sqlite_path = Path(parsed.database).resolve()
            self.engine = create_engine(
                url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=20, max_overflow=20,
                json_deserializer=decode_json,
            )
            _sqlite_pragmas(self.engine)
        else:
            self.engine = create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True, connect_args={
                **_KEEPALIVES,
                "options": f"-c lock_timeout={LOCK_TIMEOUT_MS} -c statement_timeout={STATEMENT_TIMEOUT_MS} "
                           + _SERVER_SIDE},
                json_deserializer=decode_json)  # psycopg hands it the bytes of each JSON value
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self.engine.execution_options(**{READ_ONLY: True}),
                                           expire_on_commit=False)
        self._sqlite = self.dialect == "sqlite"
        self._write_lock = threading.RLock()
        self._claim_fd: int | None = None
        self._claim_connection: Connection | None = None

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> Database:
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{data_dir.resolve() / 'vbs.db'}")

    def __repr__(self) -> str:
        return f"Database({redact(self.url)})"

    # -- one controller per SQLite file ----------------------------------------------------------

    def claim(self, holder: str = "a controller", *, controller_id: str | None = None) -> None:
        """SQLite: take this database for this process until ``dispose()``; ``DatabaseInUse`` if another
        process has it. PostgreSQL serves several controllers (their operations carry leases and
        fences): a controller claims its own id instead, so that two live ones cannot share it
        (``vbs db upgrade`` claims nothing there: its migrations take a lock of their own)."""
        if self.sqlite_path is None:
            if controller_id is not None:
                self._claim_postgresql(holder, controller_id)
            return
        if self._claim_fd is not None:
            return
        lock = self.sqlite_path.with_name(self.sqlite_path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DatabaseInUse(
                f"the SQLite database {self.sqlite_path} is in use by {other}: SQLite serves exactly one "
                "controller. Stop that one first, or run several controllers on PostgreSQL "
                "(--database-url, docs/scale-out.md).") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder} (pid {os.getpid()})\n".encode(), 0)
        self._claim_fd = fd

    def _claim_postgresql(self, holder: str, controller_id: str) -> None:
        if self._claim_connection is not None:
            return
        key = int.from_bytes(hashlib.sha256(controller_id.encode()).digest()[:4], "big", signed=True)
        with self._reaching():
            connection = self.engine.connect()
            try:
                got = connection.execute(
                    text("SELECT pg_try_advisory_lock(CAST(:ns AS integer), CAST(:key AS integer))"),
                    {"ns": CONTROLLER_LOCK_NAMESPACE, "key": key}).scalar()
                connection.commit()
            except BaseException:
                connection.close()
                raise
        if not got:
            connection.close()
            raise DatabaseInUse(
                f"a controller with the id {controller_id!r} already runs on the database {redact(self.url)}: "
                f"give each controller its own id (--controller-id; {holder} was refused).")
        self._claim_connection = connection

    # -- the database's clock and fences (docs/architecture.md §6) ----------------------------------------------

    def clock(self, session: Session) -> datetime:
        """Now, by the database's clock: leases are compared with it, never with a controller's own.
        (SQLite serves one controller on one machine: there the machine's clock is the DB's.)"""
        if self._sqlite:
            return datetime.now(UTC)
        now = session.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert isinstance(now, datetime)
        return now.astimezone(UTC)

    def next_fence(self, session: Session) -> int:
        """A fencing token larger than every one handed out before."""
        if self._sqlite:
            value = session.execute(text("UPDATE fence_counter SET value = value + 1 WHERE id = 1 "
                                         "RETURNING value")).scalar_one()
        else:
            value = session.execute(text("SELECT nextval('vbs_fence')")).scalar_one()
        return int(value)

    def clock_and_fence(self, session: Session) -> tuple[datetime, int]:
        """``clock()`` and ``next_fence()`` in one statement on PostgreSQL (one round trip, not two):
        what every new operation needs."""
        if self._sqlite:
            return self.clock(session), self.next_fence(session)
        now, value = session.execute(text("SELECT clock_timestamp(), nextval('vbs_fence')")).one()
        assert isinstance(now, datetime)
        return now.astimezone(UTC), int(value)

    def _release(self) -> None:
        if self._claim_connection is not None:
            connection, self._claim_connection = self._claim_connection, None
            try:
                connection.invalidate()  # its session ends, and the advisory lock with it
            finally:
                connection.close()
        if self._claim_fd is not None:
            os.close(self._claim_fd)  # closing the descriptor releases the flock
            self._claim_fd = None

    # -- schema ------------------------------------------------------------------------------------

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        """Connection failures as ``DatabaseUnavailable``, naming the database without its password."""
        try:
            yield
        except OperationalError as exc:
            reason = str(exc.orig or exc).strip().splitlines()[0][:500]
            raise DatabaseUnavailable(f"cannot use the database {redact(self.url)}: {reason}") from None

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent): ``vbs db upgrade``, and a
        SQLite controller at its start."""
        cfg = alembic_config()
        with self._reaching(), self.engine.begin() as connection:
            if self.dialect == "postgresql":
                # A migration may wait for the lock and rewrite big tables: no timeouts here.
                connection.execute(text("SET LOCAL lock_timeout = 0"))
                connection.execute(text("SET LOCAL statement_timeout = 0"))
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "head")

    def revisions(self) -> tuple[str | None, str]:
        """(the database's schema revision or None if it has none, the newest this VBS knows)."""
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        assert head is not None
        with self._reaching(), self.engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
        return current, head

    def check_schema(self) -> None:
        """Refuse (``SchemaMismatch``) a database whose schema is not this VBS's newest: PostgreSQL
        is upgraded only by ``vbs db upgrade``, never by a controller as it starts."""
        current, head = self.revisions()
        if current == head:
            return
        known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
        where = redact(self.url)
        if current is None:
            raise SchemaMismatch(f"the database {where} has no VBS schema yet: run `vbs db upgrade` "
                                 "(with the same --database-url) before starting the controller.")
        if current in known:
            raise SchemaMismatch(f"the database {where} has schema revision {current}, older than this VBS's "
                                 f"{head}: run `vbs db upgrade` (with the same --database-url), then start the "
                                 "controller.")
        raise SchemaMismatch(f"the database {where} has schema revision {current}, which this VBS does not know "
                             f"(its newest is {head}): it was upgraded by a newer VBS; run that version.")

    # -- transactions ------------------------------------------------------------------------------

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A writing transaction: commits on success, rolls back on an exception."""
        if not self._sqlite:
            with _disk_full(), _transient_conflicts(), _refused_values(), self._sessions() as session, \
                    session.begin():
                yield session
            return
        with _disk_full(), self._write_lock, self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only transaction (on SQLite it does not wait for writers)."""
        with _transient_conflicts(read=True), _refused_values(), self._read_sessions() as session, \
                session.begin():
            yield session

    def dispose(self) -> None:
        self._release()
        self.engine.dispose()
