"""``bench/control_plane.py --completion``: how soon a client sees a reflink snapshot completed.

On the xfs loop pool (reflink), ``vbs up`` with one 16 GiB volume holding data; then rounds of
POST /v1/snapshots followed by waiting for ``completed`` two ways, alternated round by round so both
see the same load:

* ``poll-50ms`` (the baseline): GET the snapshot at once, then every 50 ms, as clients did before;
* ``long-poll``: GET the snapshot with ``?wait=30``, which the controller answers when the snapshot's
  operation ends.

The figure is the time from sending the POST to the client holding a ``completed`` answer; the
server's own time (the operation row, POST commit to its end) is printed alongside, so the part the
waiting method adds is visible. Medians, and their ratio; the load average with every round.

Each of those snapshots is deleted after its round. Then the snapshot store's control path: a first
snapshot of the volume is kept (stored whole), and in each of ``--completion-rounds`` incremental rounds
4 KiB are written into 1 % of the volume's 512 KiB blocks and a snapshot is taken and kept: the time from
its POST to ``completed`` (long-poll) is the pool's instant reflink plus the store's incremental upload
(only the extents the reflink does not share with the previous snapshot's are read); then a volume is
created from it (the pool's fast tier: a reflink) and its first byte read from the pool file, timed from
the POST.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import log, pct, text_table
from bench.control_api import POLL_S, Api, VbsUp, server_ms
from bench.snapshot_store import change_blocks
from tests.loopfs import loop_filesystem

GIB = 1 << 30
MIB = 1 << 20
VOLUME_GIB = 16
LONG_POLL_S = 30
MODES = ("poll-50ms", "long-poll")
TARGET_SEEN_MS = 50.0


def scatter_pattern(path: Path, size: int, data_mib: int) -> None:
    """``data_mib`` of non-zero data in 16 runs spread over ``path`` (a volume with many extents)."""
    run = max(1, data_mib // 16) * MIB
    block = os.urandom(run)
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for i in range(16):
            os.pwrite(fd, block, (size - run) * i // 15)
        os.fsync(fd)
    finally:
        os.close(fd)


def seen_completed(api: Api, snapshot_id: str, mode: str) -> float:
    """Wait for ``completed`` the ``mode`` way; the monotonic time the client held it."""
    path = f"/v1/snapshots/{snapshot_id}"
    while True:
        if mode == "long-poll":
            body = api.get(path, wait=LONG_POLL_S)
        else:
            body = api.get(path)
        now = time.monotonic()
        if body["status"] == "completed":
            return now
        if body["status"] == "error":
            raise RuntimeError(f"{snapshot_id} went to error: {body.get('status_reason')}")
        if mode != "long-poll":
            time.sleep(POLL_S)


def one_round(api: Api, vid: str, mode: str, db: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    sid = api.post("/v1/snapshots", {"volume_id": vid})["snapshot_id"]
    seen = seen_completed(api, sid, mode)
    out = {"mode": mode, "seen_ms": (seen - t0) * 1000, "server_ms": server_ms(db, sid),
           "load": os.getloadavg()[0]}
    api.delete(f"/v1/snapshots/{sid}")
    return out


def upload_counts(log_path: Path, snapshot_id: str) -> str:
    """"read/new" chunks of the snapshot's upload, as the storage agent logged them."""
    found = re.search(rf"snapshot {snapshot_id} stored in .*?: (\d+) chunks, (\d+) read, (\d+) new",
                      log_path.read_text(errors="replace"))
    return f"{found.group(2)}/{found.group(3)} of {found.group(1)}" if found else "?"


def incremental_round(api: Api, vid: str, pool: Path, seed: int, log_path: Path) -> dict[str, Any]:
    """1 % of the volume's blocks changed, a snapshot to ``completed`` (kept), a volume made from it."""
    changed = len(change_blocks(pool / "volumes" / f"{vid}.raw", 0.01, seed))
    t0 = time.monotonic()
    sid = api.post("/v1/snapshots", {"volume_id": vid})["snapshot_id"]
    seen = seen_completed(api, sid, "long-poll")
    body = api.get(f"/v1/snapshots/{sid}")
    t1 = time.monotonic()
    clone = api.post("/v1/volumes", {"snapshot_id": sid})["volume_id"]
    api.wait_status(f"/v1/volumes/{clone}", "available", 600)
    with (pool / "volumes" / f"{clone}.raw").open("rb") as fh:
        fh.read(1)
    first_byte = time.monotonic()
    api.delete(f"/v1/volumes/{clone}")
    return {"changed_blocks": changed, "completed_ms": (seen - t0) * 1000, "first_byte_ms": (first_byte - t1) * 1000,
            "chunks": upload_counts(log_path, sid), "location": body.get("data_location"),
            "load": os.getloadavg()[0]}


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.completion_rounds
    data_mib = 1024 if args.quick else VOLUME_GIB * 1024
    with loop_filesystem(work, "xfs", size_mib=(VOLUME_GIB + 8) * 1024) as mnt:
        data_dir = mnt / "pool-root" / "var"
        data_dir.mkdir(parents=True)
        up = VbsUp(data_dir, mnt / "pool-root" / "vbs-up.log")
        try:
            up.start()
            api = Api(up.endpoint, up.headers())
            vid = api.post("/v1/volumes", {"size_gib": VOLUME_GIB})["volume_id"]
            api.wait_status(f"/v1/volumes/{vid}", "available", 60)
            log(f"completion: writing {data_mib} MiB over the {VOLUME_GIB} GiB volume {vid}")
            scatter_pattern(data_dir / "pool" / "volumes" / f"{vid}.raw", VOLUME_GIB * GIB, data_mib)
            for mode in MODES:  # warm-up, not counted
                one_round(api, vid, mode, data_dir / "vbs.db")
            runs = []
            for i in range(rounds):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    r = one_round(api, vid, mode, data_dir / "vbs.db")
                    runs.append(r)
                    log(f"  round {i + 1}/{rounds} {mode}: seen completed {r['seen_ms']:.1f} ms "
                        f"(server {r['server_ms'] or 0:.1f} ms, load {r['load']:.1f})")
            base = api.post("/v1/snapshots", {"volume_id": vid})["snapshot_id"]
            t0 = time.monotonic()
            seen_completed(api, base, "long-poll")
            base_s = time.monotonic() - t0
            log(f"completion: the first stored snapshot {base} took {base_s:.1f} s")
            incremental = []
            for i in range(rounds):
                r = incremental_round(api, vid, data_dir / "pool", seed=i, log_path=up.log_path)
                incremental.append(r)
                log(f"  incremental {i + 1}/{rounds}: {r['changed_blocks']} blocks changed, completed "
                    f"{r['completed_ms']:.0f} ms (chunks read/sent {r['chunks']}, {r['location']}), "
                    f"first byte of a volume from it {r['first_byte_ms']:.0f} ms, load {r['load']:.1f}")
            api.close()
        finally:
            up.stop()
    return {"rounds": rounds, "data_mib": data_mib, "runs": runs, "base_s": base_s, "incremental": incremental}


def report(figures: dict[str, Any]) -> str:
    rows, medians = [], {}
    for mode in MODES:
        runs = [r for r in figures["runs"] if r["mode"] == mode]
        seen = [r["seen_ms"] for r in runs]
        server = [r["server_ms"] for r in runs if r["server_ms"] is not None]
        # What the client adds: from the POST to its answer, and from the operation's end to seeing it.
        beyond = [r["seen_ms"] - r["server_ms"] for r in runs if r["server_ms"] is not None]
        medians[mode] = statistics.median(seen)
        rows.append([mode, f"{medians[mode]:.1f}", f"{pct(seen, 90):.1f}", f"{min(seen):.1f}-{max(seen):.1f}",
                     f"{statistics.median(server):.1f}" if server else "-",
                     f"{statistics.median(beyond):.1f}" if beyond else "-",
                     f"{statistics.median(r['load'] for r in runs):.1f}"])
    incremental = figures.get("incremental", [])
    inc_rows = [[f"{i + 1}", str(r["changed_blocks"]), f"{r['completed_ms']:.0f}", str(r["chunks"]),
                 str(r["location"]), f"{r['first_byte_ms']:.0f}", f"{r['load']:.1f}"]
                for i, r in enumerate(incremental)]
    ratio = medians["poll-50ms"] / medians["long-poll"]
    met = "met" if medians["long-poll"] <= TARGET_SEEN_MS else "missed"
    return "\n".join([
        f"\n## Completion: {VOLUME_GIB} GiB reflink snapshot seen completed after the POST "
        f"({figures['rounds']} rounds per mode, {figures['data_mib']} MiB of data in the volume)\n",
        text_table(["wait", "p50 ms", "p90 ms", "min-max ms", "server p50 ms", "seen - server p50 ms", "load p50"],
              rows),
        f"\nlong-poll vs 50 ms polling (p50): {ratio:.2f}x faster; target <= {TARGET_SEEN_MS:g} ms: {met}",
        f"\n## The store's control path: {VOLUME_GIB} GiB reflink volume, 1 % of its blocks changed per snapshot "
        f"(the first stored snapshot: {figures.get('base_s', 0):.1f} s)\n",
        text_table(["round", "blocks changed", "POST to completed ms", "chunks read/sent", "data", "first byte of a "
                    "volume from it ms", "load"], inc_rows),
    ])
