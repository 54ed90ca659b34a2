"""Where daemons' unix sockets live: in their state directory when the path fits, else under /run.

A unix socket path holds at most 107 bytes; deep state directories (tests' temp dirs, long pool
paths) exceed it. The fallback is derived from the state directory, so a restarted agent finds
(and adopts) the same socket again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SUN_PATH_MAX = 107
FALLBACK_ROOT = Path("/run/vbs")


def socket_path(state_dir: Path, name: str) -> Path:
    preferred = state_dir / name
    if len(str(preferred).encode()) <= SUN_PATH_MAX - 8:
        return preferred
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]
    short = FALLBACK_ROOT / digest
    short.mkdir(parents=True, exist_ok=True, mode=0o700)
    return short / name
