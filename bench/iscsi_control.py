#!/usr/bin/env python3
"""What one iSCSI export costs the storage agent: ``ensure_export`` of a new key and ``remove_export``,
the way this tree drives tgtd against a baseline tree (a git revision) in the same run.

Each tree runs in a child process of its own (``--worker``) with that tree's ``src`` first on the
import path: it starts a tgtd through ``IscsiExportDriver`` in a temporary directory (own control
socket, a free loopback port), exports one warm-up key, then ``--keys`` new keys one after the other
(each a target of its own, as 20 disks of one guest are: the last export sees 19 targets in tgtd),
then removes them. Every control request the driver makes is timed where it leaves the driver (a
``tgtadm`` process in the baseline: ``vbs.system.argv.run``; a request on tgtd's management socket:
``vbs.storage.exports.tgt_ipc``). The trees alternate ``--rounds`` times so that a change in the
machine's load falls on both. Prints p50/p95 of each call per tree, the requests per export, the
mean time of each kind of request, and the ratio of this tree to the baseline. tgtd is stopped by the
driver, and by SIGKILL to its PID if that fails; only 127.0.0.1 is used.

    .venv/bin/python bench/iscsi_control.py                     # 20 keys, 3 rounds a tree
    .venv/bin/python bench/iscsi_control.py --baseline-rev HEAD~3 --keys 10 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The last revision whose iSCSI driver ran one tgtadm process per request.
BASELINE_REV = "0dda73a"
VOLUME_BYTES = 16 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(record: list[tuple[str, float]], label: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            record.append((label(*args, **kw), (time.perf_counter() - t0) * 1000))
    return wrapper


def _argv_label(argv: Any, *_: Any, **__: Any) -> str:
    args = [str(a) for a in argv]
    mode = args[args.index("--mode") + 1] if "--mode" in args else "?"
    op = args[args.index("--op") + 1] if "--op" in args else "?"
    return f"tgtadm {mode} {op}"


def _instrument(record: list[tuple[str, float]]) -> None:
    """Time every control request of whichever driver this tree has."""
    from vbs.storage.exports import tgt_ipc

    try:
        from vbs.storage.exports.iscsi import tgtadm as adm_module  # the baseline: a process per request
    except ImportError:
        pass
    else:
        adm_module.run = _timed(record, _argv_label, adm_module.run)  # type: ignore[attr-defined]
    if hasattr(tgt_ipc, "exchange"):  # every request on the management socket
        tgt_ipc.exchange = _timed(record, lambda _sock, req, *a, **k: f"socket {req.label}", tgt_ipc.exchange)
    else:  # the baseline: only CHAP accounts went over the socket
        tgt_ipc.request = _timed(record, lambda *a, **k: "socket account new", tgt_ipc.request)


def worker(keys: int) -> dict[str, Any]:
    """One tree's figures (this process imports ``vbs`` from the tree on its path)."""
    from vbs.pools.exports import FileSource
    from vbs.storage.exports.iscsi import IscsiExportDriver
    from vbs.wire.connection import HostIdentity

    record: list[tuple[str, float]] = []
    _instrument(record)
    host = HostIdentity(name="hv-1", address="127.0.0.1")
    out: dict[str, Any] = {"ensure": [], "remove": [], "ensure_calls": [], "remove_calls": []}
    with tempfile.TemporaryDirectory(prefix="iscsi-ctl-", dir="/tmp") as tmp:
        vol = Path(tmp) / "vol.img"
        with open(vol, "wb") as fh:
            fh.truncate(VOLUME_BYTES)
        port = _free_port()
        drv = IscsiExportDriver(Path(tmp) / "s", port=port, control_port=port % 32768, session_grace=2.0)
        try:
            drv.start()
            warm = "vol-" + "f" * 17
            drv.ensure_export(warm, FileSource(vol), host)
            drv.remove_export(warm, host.name)
            names = [f"vol-{i:017x}" for i in range(1, keys + 1)]
            for kind, call in (("ensure", lambda k: drv.ensure_export(k, FileSource(vol), host)),
                               ("remove", lambda k: drv.remove_export(k, host.name))):
                for key in names:
                    record.clear()
                    t0 = time.perf_counter()
                    call(key)
                    out[kind].append((time.perf_counter() - t0) * 1000)
                    out[f"{kind}_calls"].append(list(record))
        finally:
            pid = drv.pid
            try:
                drv.stop()
            finally:
                if pid is not None and Path(f"/proc/{pid}").exists():
                    os.kill(pid, signal.SIGKILL)
    return out


def _tree(rev: str, into: Path) -> Path:
    """The ``src`` of ``rev``, extracted from git."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True,  # noqa: S607
                             check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)  # noqa: S607
    return into / "src"


def _run_worker(src: Path, keys: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, __file__, "--worker", "--src", str(src), "--keys", str(keys)],
                          capture_output=True, text=True, env=env, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker on {src} failed: {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout))


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def report(results: dict[str, list[dict[str, Any]]], keys: int) -> None:
    from bench.common import text_table

    merged: dict[str, dict[str, list[Any]]] = {}
    for tree, runs in results.items():
        m: dict[str, list[Any]] = defaultdict(list)
        for run in runs:
            for k, v in run.items():
                m[k].extend(v)
        merged[tree] = m
    rows = []
    for tree, m in merged.items():
        per_ensure = [len(c) for c in m["ensure_calls"]]
        per_remove = [len(c) for c in m["remove_calls"]]
        rows.append([tree, f"{_pct(m['ensure'], 50):.1f}", f"{_pct(m['ensure'], 95):.1f}",
                     f"{statistics.mean(per_ensure):.1f}", f"{_pct(m['remove'], 50):.1f}",
                     f"{_pct(m['remove'], 95):.1f}", f"{statistics.mean(per_remove):.1f}"])
    print(f"\niSCSI export control: {keys} new keys per round, {len(next(iter(results.values())))} round(s) per tree")
    print(text_table(["tree", "ensure p50 ms", "ensure p95 ms", "requests/ensure", "remove p50 ms",
                      "remove p95 ms", "requests/remove"], rows))
    for tree, m in merged.items():
        by_kind: dict[str, list[float]] = defaultdict(list)
        for calls in m["ensure_calls"] + m["remove_calls"]:
            for label, ms in calls:
                by_kind[label].append(ms)
        print(f"\n{tree}: time per request")
        print(text_table(["request", "count", "mean ms", "p95 ms"],
                         [[k, str(len(v)), f"{statistics.mean(v):.2f}", f"{_pct(v, 95):.2f}"]
                          for k, v in sorted(by_kind.items())]))
    if len(merged) == 2:
        (base, bm), (new, nm) = list(merged.items())
        print(f"\nratio {new} / {base}: ensure p50 {_pct(nm['ensure'], 50) / _pct(bm['ensure'], 50):.2f}, "
              f"remove p50 {_pct(nm['remove'], 50) / _pct(bm['remove'], 50):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=20, help="new keys exported per round (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per tree, alternating (default 3)")
    p.add_argument("--baseline-rev", default=BASELINE_REV,
                   help=f"git revision of the baseline (default {BASELINE_REV}); 'none' for this tree alone")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        sys.path.insert(0, str(args.src))
        json.dump(worker(args.keys), sys.stdout)
        return
    sys.path.insert(0, str(REPO))
    from bench.common import log

    with tempfile.TemporaryDirectory(prefix="iscsi-ctl-trees-") as tmp:
        trees = {}
        if args.baseline_rev != "none":
            try:
                trees[f"baseline {args.baseline_rev}"] = _tree(args.baseline_rev, Path(tmp))
            except subprocess.CalledProcessError:
                log(f"revision {args.baseline_rev} is not in this clone (a shallow one?): this tree alone")
        trees["this tree"] = REPO / "src"
        results: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
        for r in range(args.rounds):
            for name, src in trees.items():
                log(f"round {r + 1}/{args.rounds}: {name}")
                results[name].append(_run_worker(src, args.keys))
    report(results, args.keys)
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
