"""The controller on PostgreSQL and on SQLite as operators start it: schema upgrades are an explicit
``vbs db upgrade``, one controller per SQLite file, ``vbs up --postgres`` and its own cluster, and a
database password that reaches no command line, environment or log.

Real processes throughout (``vbs controller``, ``vbs up``, ``vbs db``) against real PostgreSQL 15.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text

from tests.conftest import VBS, Services, VbsUp, free_port, stop_process, wait_until
from tests.postgres_cluster import PostgresForTests
from vbs.controller.db import Database
from vbs.controller.db.session import alembic_config

pytestmark = pytest.mark.integration

SECRET = "s3cr3t-Pa55word"
# This VBS's schema revision, whatever the newest migration is.
HEAD = ScriptDirectory.from_config(alembic_config()).get_current_head()


def start_controller(svc: Services, *flags: str, port: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*VBS, "controller", "--port", str(port or svc.port), "--data-dir", str(svc.data_dir),
                             *flags], env=svc.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def refused(proc: subprocess.Popen[str]) -> str:
    """The output of a controller that must refuse to start (it exits 1 at once)."""
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    assert proc.returncode == 1, out
    return out


def healthy(svc: Services) -> bool:
    return bool(svc.vbs.http.get("/health").status_code == 200)


def revision(url: str) -> str | None:
    db = Database(url)
    try:
        return db.revisions()[0]
    finally:
        db.dispose()


def vbs_db(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VBS, "db", *args], capture_output=True, text=True, timeout=120)


# -- schema upgrades are explicit on PostgreSQL ---------------------------------------------------------


def test_vbs_db_upgrade_then_the_controller_starts(services: Services, postgres: PostgresForTests) -> None:
    url = postgres.new_database()
    out = refused(start_controller(services, "--database-url", url))
    assert "SchemaMismatch" in out and "no VBS schema yet" in out and "vbs db upgrade" in out
    assert revision(url) is None, "a controller on PostgreSQL must never migrate on its own"

    upgraded = vbs_db("upgrade", "--database-url", url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"upgraded from nothing to {HEAD}" in upgraded.stdout
    assert vbs_db("status", "--database-url", url).returncode == 0

    proc = start_controller(services, "--database-url", url)
    try:
        wait_until(lambda: healthy(services), 60, what="controller on PostgreSQL")
        r = services.vbs.http.get("/v1/volumes")
        assert r.status_code == 200 and r.json()["volumes"] == []
    finally:
        stop_process(proc)  # type: ignore[arg-type]


def test_a_controller_refuses_a_schema_behind_or_ahead_of_it(services: Services, postgres: PostgresForTests) -> None:
    url = postgres.new_database()
    db = Database(url)
    cfg = alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0003")  # what an older VBS left
    behind = vbs_db("status", "--database-url", url)
    assert behind.returncode == 1 and "schema revision 0003" in behind.stdout

    out = refused(start_controller(services, "--database-url", url))
    assert f"revision 0003, older than this VBS's {HEAD}" in out and "vbs db upgrade" in out
    assert revision(url) == "0003"

    with db.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    out = refused(start_controller(services, "--database-url", url))
    assert "revision 0099, which this VBS does not know" in out and "newer VBS" in out
    db.dispose()


def test_several_controllers_share_a_postgresql_database_but_not_an_id(services: Services,
                                                                       postgres: PostgresForTests) -> None:
    """Operations carry leases and fences (docs/architecture.md §6): a second controller runs beside the first, each
    under its own id; a second one under an id that a live controller holds is refused."""
    url = postgres.new_database()
    assert vbs_db("upgrade", "--database-url", url).returncode == 0
    first = start_controller(services, "--database-url", url, "--controller-id", "ctl-a")
    second_port = free_port()
    second = start_controller(services, "--database-url", url, "--controller-id", "ctl-b", port=second_port)
    try:
        wait_until(lambda: healthy(services), 60, what="the first controller on PostgreSQL")
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{second_port}/health").status_code == 200, 60,
                   what="the second controller")
        out = refused(start_controller(services, "--database-url", url, "--controller-id", "ctl-a",
                                       port=free_port()))
        assert "DatabaseInUse" in out and "'ctl-a' already runs" in out
        listed = wait_until(lambda: (c := services.vbs.cli("describe-controllers")["controllers"]) and len(c) == 2
                            and c, 30, what="both controllers listed")
        assert [(c["controller_id"], c["state"]) for c in listed] == [("ctl-a", "up"), ("ctl-b", "up")]
        assert listed[1]["url"] == f"http://127.0.0.1:{second_port}"
        # A schema upgrade under running controllers is refused unless forced.
        busy = vbs_db("upgrade", "--database-url", url)
        assert busy.returncode == 1 and "ctl-a, ctl-b" in busy.stderr and "stop them" in busy.stderr
        assert vbs_db("upgrade", "--database-url", url, "--force").returncode == 0
        assert healthy(services), "the first controller goes on"
    finally:
        stop_process(second)  # type: ignore[arg-type]
        stop_process(first)  # type: ignore[arg-type]
    again = start_controller(services, "--database-url", url, "--controller-id", "ctl-a")
    try:
        wait_until(lambda: healthy(services), 60, what="ctl-a again once the first one stopped")
    finally:
        stop_process(again)  # type: ignore[arg-type]


# -- SQLite: exactly one controller ------------------------------------------------------------------------


def test_a_second_controller_on_the_same_sqlite_file_is_refused(services: Services) -> None:
    services.start_controller()
    out = refused(start_controller(services, port=free_port()))
    assert "DatabaseInUse" in out and "SQLite serves exactly one controller" in out
    assert f"a controller (pid {services.controller.pid})" in out  # type: ignore[union-attr]
    assert healthy(services), "the first controller goes on"

    upgrade = vbs_db("upgrade", "--data-dir", str(services.data_dir))
    assert upgrade.returncode == 1 and "DatabaseInUse" in upgrade.stderr

    stop_process(services.controller)  # type: ignore[arg-type]
    proc = start_controller(services)
    try:
        wait_until(lambda: healthy(services), 60, what="the controller after the first one stopped")
    finally:
        stop_process(proc)  # type: ignore[arg-type]


def test_vbs_db_upgrade_of_a_new_sqlite_data_dir_makes_private_files(tmp_path: Path) -> None:
    data_dir = tmp_path / "var"
    upgraded = vbs_db("upgrade", "--data-dir", str(data_dir))
    assert upgraded.returncode == 0 and f"upgraded from nothing to {HEAD}" in upgraded.stdout
    assert vbs_db("status", "--data-dir", str(data_dir)).returncode == 0
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    for name in ("vbs.db", "vbs.db.lock"):
        assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name


# -- no password on argv, in a child's environment, or in a log ---------------------------------------------


def test_a_database_password_is_never_shown(services: Services, postgres: PostgresForTests, tmp_path: Path) -> None:
    # A database that does not exist: the controller's error names it, without the password.
    missing = postgres.cluster.url("nosuchdb").replace("vbs@", f"vbs:{SECRET}@")
    url_file = tmp_path / "db-url"
    url_file.write_text(missing + "\n")
    url_file.chmod(0o600)
    out = refused(start_controller(services, "--database-url-file", str(url_file)))
    assert "DatabaseUnavailable" in out and "nosuchdb" in out and "***" in out
    assert SECRET not in out

    out = refused(start_controller(services, "--database-url", missing))
    assert "the database URL on the command line carries a password" in out
    assert SECRET not in out


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_vbs_up_hands_the_database_url_to_its_controller_as_a_private_file(tmp_path: Path,
                                                                          postgres: PostgresForTests) -> None:
    # Trust authentication ignores the password, so this URL works and the install really runs on it.
    url = postgres.upgraded_database().replace("vbs@", f"vbs:{SECRET}@")
    given = tmp_path / "db-url"
    given.write_text(url + "\n")
    given.chmod(0o600)
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", extra=["--database-url-file", str(given)])
    vbs = up.start()
    try:
        vol = vbs.cli("create-volume", "--size", "1", "--wait")
        assert vol["status"] == "available"
        assert up.proc is not None
        for pid in [up.proc.pid, *_children(up.proc.pid)]:
            assert SECRET.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert SECRET.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        handed = tmp_path / "var" / "database-url"
        assert stat.S_IMODE(handed.stat().st_mode) == 0o600 and handed.read_text().strip() == url
    finally:
        up.stop()
    assert SECRET not in up.log_path.read_text()


# -- vbs up --postgres --------------------------------------------------------------------------------------


@pytest.fixture
def enterable_dir() -> Iterator[Path]:
    """A directory the postgres user may enter (the tests' tmp_path is under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="vbs-up-pg-", dir="/tmp"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _postmaster(data_dir: Path) -> int:
    return int((data_dir / "postgres" / "data" / "postmaster.pid").read_text().split("\n", 1)[0])


def test_vbs_up_postgres_runs_on_its_own_cluster_and_stops_it(enterable_dir: Path) -> None:
    data_dir = enterable_dir / "var"
    up = VbsUp(data_dir, enterable_dir / "up.log", extra=["--postgres"])
    vbs = up.start()
    try:
        vol = vbs.cli("create-volume", "--size", "1", "--comment", "on-postgres", "--wait")
        postmaster = _postmaster(data_dir)
        assert Path(f"/proc/{postmaster}").exists()
        assert not (data_dir / "vbs.db").exists(), "the metadata is in PostgreSQL, not SQLite"
        st = data_dir.stat()
        assert stat.S_IMODE(st.st_mode) == 0o710 and st.st_gid == grp.getgrnam("postgres").gr_gid
        cluster = (data_dir / "postgres").stat()
        assert cluster.st_uid == pwd.getpwnam("postgres").pw_uid and stat.S_IMODE(cluster.st_mode) == 0o700
        assert stat.S_IMODE((data_dir / "database-url").stat().st_mode) == 0o600
    finally:
        up.stop()
    wait_until(lambda: not Path(f"/proc/{postmaster}").exists(), 30, what="the postmaster gone")
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o710, "the controller's start kept the data dir enterable"

    again = VbsUp(data_dir, enterable_dir / "up2.log", extra=["--postgres"])
    again.port = up.port
    vbs = again.start()
    try:
        assert vbs.volume(vol["volume_id"])["comment"] == "on-postgres"
    finally:
        again.stop()

    sqlite = subprocess.run([*VBS, "up", "--data-dir", str(data_dir), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60)
    assert sqlite.returncode == 1 and "start it with vbs up --postgres" in sqlite.stderr


def test_vbs_up_postgres_refuses_a_data_dir_postgres_cannot_reach(tmp_path: Path) -> None:
    # tmp_path is under /tmp/pytest-of-root (0700).
    proc = subprocess.run([*VBS, "up", "--postgres", "--data-dir", str(tmp_path / "var"), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "the postgres user cannot enter" in proc.stderr and "--database-url" in proc.stderr
