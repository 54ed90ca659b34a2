#!/usr/bin/env python3
"""Attach p50 across a bridge of network namespaces against the same over loopback: prints figures (it
is not a test). Run as root.

Across the bridge: the namespace cluster of docs/install.md (``tests/netns_install.py``, the one
``tests/test_netns_cluster.py`` installs from the wheel with the guide's commands: TLS on every hop,
PostgreSQL on its own machine, two controllers, the storage node stor-1 serving NBD, the hypervisor
node hv-1 with a TCG guest, the CLI on the client machine). Over loopback, in the same run: ``vbs up``
with a TCG guest on this machine (SQLite, unix sockets between its services). On each, ``--rounds``
times: ``vbs attach-volume VOL --host … --vm … --wait`` of one NBD volume, timed by the caller until
the CLI returns (the attachment ``attached``: the disk is in the VM), then a detach. Figures: the CLI's
p50 and p90, and the server's (the attach operation's row, from the commit of the request to its last
update), with the ratio bridge / loopback. The CLI figure includes the CLI's own start (a Python
process) on both sides. Everything is stopped by its PID and the namespaces removed at the end.

    .venv/bin/python bench/netns_attach.py --quick     # 3 rounds each (about three minutes)
    .venv/bin/python bench/netns_attach.py             # 10 rounds each
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO))

from bench.common import log  # noqa: E402
from tests.conftest import vbs_up_with_guest  # noqa: E402
from tests.installed import install  # noqa: E402
from tests.netns_install import netns_cluster  # noqa: E402


def _seconds(rows: list[tuple[object, object]]) -> list[float]:
    out = []
    for start, end in rows:
        a = start if isinstance(start, datetime) else datetime.fromisoformat(str(start))
        b = end if isinstance(end, datetime) else datetime.fromisoformat(str(end))
        out.append((b - a).total_seconds())
    return out


def timed_rounds(label: str, rounds: int, attach: Callable[[], object], detach: Callable[[], object]) -> list[float]:
    """Seconds of each of ``rounds`` attaches, each followed by its detach (not timed)."""
    out: list[float] = []
    for r in range(rounds):
        started = time.monotonic()
        attach()
        out.append(time.monotonic() - started)
        log(f"{label} round {r + 1}: {out[-1]:.2f} s")
        detach()
    return out


def across_the_bridge(rounds: int, work: Path) -> tuple[list[float], list[float]]:
    """(the CLI's seconds, the server's seconds) of ``rounds`` attaches on the namespace cluster."""
    import psycopg

    root = work / "install"
    root.mkdir(mode=0o755)
    installed = install(root)
    with netns_cluster(installed) as c:
        vol = c.create("stor-1")
        cli = timed_rounds("bridge", rounds, lambda: c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1",
                                                            "--wait"), lambda: c.detach(vol))
        assert c.database is not None
        with psycopg.connect(host=str(c.database.run), port=c.database.port, user="vbs", dbname="vbs") as conn:
            rows = conn.execute("SELECT created_at, updated_at FROM operations WHERE resource_id = %s AND "
                                "kind = 'attach-volume' ORDER BY created_at", (vol,)).fetchall()
        c.cli("delete-volume", vol, "--wait")
    return cli, _seconds([(a, b) for a, b in rows])


def over_loopback(rounds: int, work: Path) -> tuple[list[float], list[float]]:
    """The same on ``vbs up`` with a guest on this machine."""
    with vbs_up_with_guest(work) as (vbs, _up, _guest):
        vol = str(vbs.cli("create-volume", "--size", "1", "--wait")["volume_id"])
        cli = timed_rounds("loopback", rounds, lambda: vbs.cli("attach-volume", vol, "--host", "host-1", "--vm",
                                                               "vm1", "--wait"),
                           lambda: vbs.cli("detach-volume", vol, "--wait"))
        con = sqlite3.connect(f"file:{vbs.data_dir / 'vbs.db'}?mode=ro", uri=True, timeout=10)
        try:
            rows = con.execute("SELECT created_at, updated_at FROM operations WHERE resource_id = ? AND "
                               "kind = 'attach-volume' ORDER BY created_at", (vol,)).fetchall()
        finally:
            con.close()
        vbs.cli("delete-volume", vol, "--wait")
    return cli, _seconds(rows)


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 rounds each")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    if not 1 <= args.rounds <= 200:
        raise SystemExit("--rounds takes 1 to 200")
    if os.geteuid() != 0:
        raise SystemExit("bench/netns_attach.py makes network namespaces and a user: run it as root")
    # Every user may enter it: the cluster's controllers run the installed venv as the guide's user vbs.
    work = Path(tempfile.mkdtemp(prefix="vbsna", dir="/var/tmp"))
    work.chmod(0o755)
    try:
        bridge = across_the_bridge(args.rounds, work)
        loopback = over_loopback(args.rounds, work / "up")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nattach-volume --wait of one NBD volume, {args.rounds} rounds each; load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'':28} {'loopback':>10} {'bridge':>10} {'ratio':>6}")
    for label, k in (("CLI p50 (s)", 0), ("server p50 (s)", 1)):
        lo, br = statistics.median(loopback[k]), statistics.median(bridge[k])
        print(f"{label:28} {lo:10.3f} {br:10.3f} {br / lo:6.2f}")
    for label, k in (("CLI p90 (s)", 0), ("server p90 (s)", 1)):
        lo, br = _p(loopback[k], 0.9), _p(bridge[k], 0.9)
        print(f"{label:28} {lo:10.3f} {br:10.3f} {br / lo:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
