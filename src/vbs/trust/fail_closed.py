"""What every service checks before it serves: credentials, TLS off loopback, private files.

A service without its credentials, or bound to a non-loopback address without TLS, refuses to
start unless it is told ``--insecure``; then it says so, loudly, on every start.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

from vbs.errors import InvalidParameter
from vbs.net.web import is_loopback
from vbs.trust.tls import TlsFiles

log = logging.getLogger(__name__)

# Files of a data dir that are meant to be read by others (clients verify the services with it).
PUBLIC_FILES = frozenset({"ca.pem"})
# Where an embedded PostgreSQL cluster (vbs.rigs.postgres) lives inside a data dir.
POSTGRES_CLUSTER_DIR = "postgres"


def holds_cluster(directory: Path) -> bool:
    """Whether ``directory`` holds an embedded cluster (its ``postgres/`` is owned by another user
    and shares the directory's group): then it stays enterable by that group (0710)."""
    try:
        inner = (directory / POSTGRES_CLUSTER_DIR).lstat()
        outer = directory.stat()
    except OSError:
        return False
    return stat.S_ISDIR(inner.st_mode) and inner.st_uid != os.geteuid() and inner.st_gid == outer.st_gid


def check_start(service: str, cfg: Any, *, has_credentials: bool, what: str) -> TlsFiles | None:
    """The TLS files the service serves with; raises if it must not start. ``what`` names the
    credential it needs, for the error message."""
    tls = TlsFiles.of(cfg)
    problems = []
    if not has_credentials:
        problems.append(f"no {what}")
    if not is_loopback(cfg.host) and (tls is None or not tls.serves):
        problems.append(f"listening on {cfg.host} without TLS (--tls-cert/--tls-key)")
    if problems and not cfg.insecure:
        raise InvalidParameter(f"{service} refuses to start: {'; '.join(problems)}. Give --insecure to run "
                               f"like this anyway (anyone who can reach it can use it).")
    if cfg.insecure:
        log.warning("%s runs with --insecure%s", service, (": " + "; ".join(problems)) if problems else "")
    return tls


def harden(*dirs: Path) -> None:
    """umask 077 for everything this process makes; its directories 0700 and their files 0600, also
    when they existed before with wider modes (only the top level: the rest was made under this umask).

    A data dir that holds an embedded PostgreSQL cluster (``vbs up --postgres``) stays 0710: its
    group (``postgres``) may enter it to reach the cluster's own directory, and list nothing."""
    os.umask(0o077)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        if d.stat().st_uid != os.geteuid():
            continue  # a directory another user owns (e.g. a PostgreSQL cluster): not ours to change
        d.chmod(0o710 if holds_cluster(d) else 0o700)
        for entry in d.iterdir():
            try:
                st = entry.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and entry.name not in PUBLIC_FILES and st.st_mode & 0o077:
                entry.chmod(0o600)
            elif stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
                entry.chmod(0o700)
