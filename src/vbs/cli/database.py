"""``vbs db``: the metadata database's schema, upgraded as an explicit step.

A controller on PostgreSQL never changes its schema: ``vbs db upgrade`` does, once, before the new
controllers start (they refuse a schema that is behind or ahead). On SQLite (the embedded default)
the controller still upgrades at start; ``vbs db upgrade`` works there too, and refuses while a
controller holds the file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from vbs.controller.db import Database

db_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,  # plain help, as vbs.cli.main's
                     help="The metadata database: its schema revision and upgrades.")

ConfigOpt = Annotated[Path | None, typer.Option(help="vbs.toml (its [controller] section).")]
DataDirOpt = Annotated[Path | None, typer.Option(help="The controller's data dir (SQLite: <dir>/vbs.db).")]
UrlOpt = Annotated[str | None, typer.Option(
    help="postgresql+psycopg://USER@HOST/DB (a password here is visible to other users: prefer the file).")]
LIVE_CONTROLLER_S = 60.0
UrlFileOpt = Annotated[Path | None, typer.Option(help="A 0600 file whose first line is the database URL.")]


def warn_if_password_on_argv(url: str | None) -> None:
    from vbs.controller.db.session import has_password

    if url is not None and has_password(url):
        print("warning: the database URL on the command line carries a password, which other users of this "
              "machine can read in the process list; put it in a 0600 file and give --database-url-file",
              file=sys.stderr)


def _database(config: Path | None, data_dir: Path | None, database_url: str | None,
              database_url_file: Path | None) -> Database:
    from vbs import config as cfgmod
    from vbs.controller.app import database_for
    from vbs.trust.fail_closed import harden

    warn_if_password_on_argv(database_url)
    cfg = cfgmod.load(cfgmod.ControllerConfig, "controller", config_file=config, overrides={
        "data_dir": data_dir, "database_url": database_url, "database_url_file": database_url_file})
    db = database_for(cfg)
    if db.sqlite_path is not None:
        harden(db.sqlite_path.parent)  # the file this may create is the controller's: 0600 in a 0700 dir
    return db


@db_app.command("upgrade")
def upgrade(config: ConfigOpt = None, data_dir: DataDirOpt = None, database_url: UrlOpt = None,
            database_url_file: UrlFileOpt = None,
            force: Annotated[bool, typer.Option("--force", help="Upgrade even while controllers run.")] = False,
            ) -> None:
    """Bring the schema to this VBS's newest revision (run it before starting upgraded controllers)."""
    from vbs.controller.cluster import live_controllers
    from vbs.controller.db.session import redact

    db = _database(config, data_dir, database_url, database_url_file)
    try:
        db.claim("vbs db upgrade")
        running = live_controllers(db, LIVE_CONTROLLER_S) if db.dialect == "postgresql" else []
        if running and not force:
            print(f"{redact(db.url)}: controllers ran in the last minute ({', '.join(sorted(running))}): stop them "
                  "before upgrading the schema (or --force, for a migration known to be additive)", file=sys.stderr)
            raise typer.Exit(1)
        before, head = db.revisions()
        db.migrate()
    finally:
        db.dispose()
    if before == head:
        print(f"{redact(db.url)}: schema already at revision {head}")
    else:
        print(f"{redact(db.url)}: schema upgraded from {before or 'nothing'} to {head}")


@db_app.command("status")
def status(config: ConfigOpt = None, data_dir: DataDirOpt = None, database_url: UrlOpt = None,
           database_url_file: UrlFileOpt = None) -> None:
    """The database's schema revision and this VBS's newest; exit 1 when they differ."""
    from vbs.controller.db.session import redact

    db = _database(config, data_dir, database_url, database_url_file)
    try:
        current, head = db.revisions()
    finally:
        db.dispose()
    print(f"{redact(db.url)}: schema revision {current or 'none'}, this VBS's newest {head}")
    if current != head:
        raise typer.Exit(1)
