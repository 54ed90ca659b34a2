#!/usr/bin/env python3
"""Snapshot store benchmark: uploads to and restores from a ``dir`` store, against reading and copying
the same data on the same disk in the same run (docs/snapshots.md; figures in docs/benchmarks.md).

On the work directory's file system, with zstd compression on (the store's format) and 8 requests in
flight (the agent's default):

* ``read``: the pool file read to /dev/null (``dd bs=4M``): the baseline of an upload;
* ``first upload``: the volume (random data: nothing compresses, nothing is a zero chunk) into an empty
  store; ratio to ``read`` (target >= 0.5);
* ``incremental, hashed``: the next snapshot after 1 % of its 512 KiB blocks changed, found by reading
  and hashing every chunk (what a pool that cannot tell what changed does: an unchanged chunk is never
  sent again, but every one is read); ratio to the first upload's time;
* ``incremental, change list``: the same with the list of changed blocks a pool that tracks them gives
  (RBD diff, reflink extents, a dirty bitmap): only those chunks are read; ratio to the first upload's
  time (target <= 0.05);
* ``ten snapshots``: ten snapshots, 1 % changed between each: the store's bytes against one full image
  (target <= 1.15);
* ``sparse volume``: a volume of ``--size-gib`` with 1/16 of it data: the store's bytes against its data;
* ``restore``: the first snapshot restored into a new file; ratio to ``cp --sparse=always`` of the pool
  file on the same disk (target >= 0.5).

With ``--radosgw GIB``, the same first upload and restore of a ``GIB`` GiB volume go to and from an S3
store on a RADOS Gateway (Debian's ``radosgw`` on an embedded single-node Ceph, one OSD on a file of the
work directory's disk, the same 8 requests in flight), beside a ``dir`` store of the same data in the
same run: the rates, and the gateway's against the directory's.

Root drops the page cache before each timed read (``sync; echo 3 > /proc/sys/vm/drop_caches``).

    .venv/bin/python bench/snapshot_store.py              # 16 GiB (about 15 minutes on 2 cores)
    .venv/bin/python bench/snapshot_store.py --quick      # 2 GiB
    .venv/bin/python bench/snapshot_store.py --quick --radosgw 2   # and 2 GiB to and from radosgw
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.common import drop_caches, log, markdown_table  # noqa: E402

from vbs.snapshot_store import DirStore, StoreKey, restore_snapshot, upload_snapshot  # noqa: E402
from vbs.snapshot_store.blocks import BlockRange  # noqa: E402
from vbs.snapshot_store.contract import SnapshotStore  # noqa: E402
from vbs.snapshot_store.format import BLOCK_SIZE, Manifest  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
VOL = "vol-00000000000000b01"
KEY = StoreKey(os.urandom(32))
TENANT_KEY = KEY.tenant_key("bench")
TARGET_FIRST = 0.5
TARGET_INCREMENTAL = 0.05
TARGET_TEN = 1.15
TARGET_RESTORE = 0.5


def write_random(path: Path, size: int, *, every: int = 1, seed: int = 1) -> None:
    """``size`` bytes: random data in 1 MiB pieces, one in ``every`` (the rest holes)."""
    rng = random.Random(seed)
    with path.open("wb") as fh:
        fh.truncate(size)
        for offset in range(0, size, MIB * every):
            fh.seek(offset)
            fh.write(rng.randbytes(MIB))
        fh.flush()
        os.fsync(fh.fileno())


def change_blocks(path: Path, fraction: float, seed: int) -> list[BlockRange]:
    """Overwrite 4 KiB in ``fraction`` of the file's 512 KiB blocks; the blocks changed."""
    size = path.stat().st_size
    blocks = size // BLOCK_SIZE
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(blocks), max(1, int(blocks * fraction))))
    with path.open("r+b") as fh:
        for b in chosen:
            fh.seek(b * BLOCK_SIZE + rng.randrange(0, BLOCK_SIZE // 4096) * 4096)
            fh.write(rng.randbytes(4096))
        fh.flush()
        os.fsync(fh.fileno())
    return [BlockRange(b, 1) for b in chosen]


def timed(fn: object) -> float:
    assert callable(fn)
    drop_caches()
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "chunks").rglob("*") if p.is_file())


def upload(store: DirStore, path: Path, snap: int, previous: Manifest | None = None,
           changed: list[BlockRange] | None = None) -> Manifest:
    result = upload_snapshot(store, path, path.stat().st_size, snapshot_id=f"snap-{snap:017x}", volume_id=VOL,
                             tenant="bench", tenant_key=TENANT_KEY, previous=previous, changed_blocks=changed)
    return result.manifest


def up_and_down(store: SnapshotStore, vol: Path, size: int, target: Path) -> tuple[float, float]:
    """The seconds of a first upload of ``vol`` into ``store`` and of its restore into ``target``."""
    found: list[Manifest] = []
    up_s = timed(lambda: found.append(upload_snapshot(
        store, vol, size, snapshot_id="snap-00000000000000b02", volume_id=VOL, tenant="bench",
        tenant_key=TENANT_KEY).manifest))
    down_s = timed(lambda: restore_snapshot(store, found[0], target, tenant_key=TENANT_KEY))
    target.unlink()
    return up_s, down_s


def radosgw_rows(size_gib: int, work: Path) -> list[list[str]]:
    """A first upload and a restore of ``size_gib`` GiB to and from a ``dir`` store and a RADOS Gateway."""
    from vbs.rigs.ceph import EmbeddedCeph
    from vbs.rigs.radosgw import EmbeddedRadosGateway
    from vbs.snapshot_store.s3 import S3Store

    size = size_gib * GIB
    vol = work / "s3-volume.raw"
    write_random(vol, size, seed=7)
    cluster = EmbeddedCeph(work, osd_size_gib=max(10, 3 * size_gib))
    gateway = EmbeddedRadosGateway(cluster)
    rows: list[list[str]] = []
    try:
        log("starting a single-node Ceph and its RADOS Gateway")
        cluster.start()
        gateway.start()
        creds = work / "s3-credentials"
        gateway.s3_user("vbs-bench", creds)
        gateway.create_bucket("vbs-bench", creds)
        s3 = S3Store.from_config({"endpoint_url": gateway.endpoint, "bucket": "vbs-bench", "prefix": "bench",
                                  "region": "us-east-1", "credentials_file": str(creds)}, default_dir=work)
        local = DirStore(work / "s3-beside")
        for name, store in (("dir", local), ("radosgw", s3)):
            up_s, down_s = up_and_down(store, vol, size, work / f"s3-restored-{name}.raw")
            rows.append([f"{name}: first upload ({size_gib} GiB)", f"{size / up_s / 1e6:.0f} MB/s", "", ""])
            rows.append([f"{name}: restore ({size_gib} GiB)", f"{size / down_s / 1e6:.0f} MB/s", "", ""])
            log(f"{name}: upload {up_s:.1f} s, restore {down_s:.1f} s")
        for k in (0, 1):  # the gateway's rates against the directory's
            dir_rate, gw_rate = (float(rows[i][1].split()[0]) for i in (k, k + 2))
            rows[k + 2][2] = f"{gw_rate / dir_rate:.2f}"
            rows[k + 2][3] = "of the dir store's (no target)"
    finally:
        gateway.stop()
        cluster.stop()
        vol.unlink(missing_ok=True)
    return rows


def run(args: argparse.Namespace) -> int:
    size = args.size_gib * GIB
    work = Path(tempfile.mkdtemp(prefix="vbs-bench-store-", dir=args.work_dir))
    rows: list[list[str]] = []
    try:
        vol = work / "volume.raw"
        log(f"writing {args.size_gib} GiB of random data")
        write_random(vol, size)
        store = DirStore(work / "store")

        read_s = timed(lambda: subprocess.run(["dd", f"if={vol}", "of=/dev/null", "bs=4M"], check=True,
                                              capture_output=True))
        rows.append(["read (dd to /dev/null)", f"{size / read_s / 1e6:.0f} MB/s", "1.00", "baseline"])
        log(f"read {read_s:.1f} s")

        manifests: list[Manifest] = []
        first_s = timed(lambda: manifests.append(upload(store, vol, 1)))
        full = store_bytes(work / "store")
        rows.append(["first upload", f"{size / first_s / 1e6:.0f} MB/s", f"{read_s / first_s:.2f}",
                     f">= {TARGET_FIRST} of read"])
        log(f"first upload {first_s:.1f} s, store {full / GIB:.2f} GiB")

        changed = change_blocks(vol, 0.01, seed=2)
        hashed_s = timed(lambda: manifests.append(upload(store, vol, 2, previous=manifests[-1])))
        rows.append(["incremental, hashed (1 % changed)", f"{hashed_s:.1f} s", f"{hashed_s / first_s:.3f}",
                     "of the first upload's time (no target: every chunk read)"])
        changed = change_blocks(vol, 0.01, seed=3)
        listed_s = timed(lambda: manifests.append(upload(store, vol, 3, previous=manifests[-1], changed=changed)))
        rows.append(["incremental, change list (1 % changed)", f"{listed_s:.2f} s", f"{listed_s / first_s:.3f}",
                     f"<= {TARGET_INCREMENTAL} of the first upload's time"])
        log(f"incremental: hashed {hashed_s:.1f} s, with a change list {listed_s:.2f} s")

        for snap in range(4, 11):  # ten snapshots in all, 1 % changed between each
            changed = change_blocks(vol, 0.01, seed=snap)
            manifests.append(upload(store, vol, snap, previous=manifests[-1], changed=changed))
        ten = store_bytes(work / "store")
        rows.append(["ten snapshots (1 % changed between each)", f"{ten / GIB:.2f} GiB", f"{ten / full:.3f}",
                     f"<= {TARGET_TEN} of one full image"])

        restored = work / "restored.raw"
        restore_s = timed(lambda: restore_snapshot(store, manifests[0], restored, tenant_key=TENANT_KEY))
        copy = work / "copy.raw"
        cp_s = timed(lambda: (subprocess.run(["cp", "--sparse=always", str(vol), str(copy)], check=True),
                              subprocess.run(["sync", str(copy)], check=True)))
        rows.append(["restore", f"{size / restore_s / 1e6:.0f} MB/s", f"{cp_s / restore_s:.2f}",
                     f">= {TARGET_RESTORE} of cp --sparse=always ({size / cp_s / 1e6:.0f} MB/s)"])
        log(f"restore {restore_s:.1f} s, cp {cp_s:.1f} s")
        for p in (restored, copy, vol):
            p.unlink()

        sparse = work / "sparse.raw"
        write_random(sparse, size, every=16, seed=2)  # data of its own: nothing to share with the first
        before = store_bytes(work / "store")
        upload(store, sparse, 11)
        data = size // 16
        cost = store_bytes(work / "store") - before
        rows.append([f"sparse volume ({args.size_gib} GiB, {data / GIB:.2f} GiB data)", f"{cost / GIB:.2f} GiB",
                     f"{cost / data:.3f}", "of its data"])
        if args.radosgw:
            rows += radosgw_rows(args.radosgw, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nSnapshot store (dir), {args.size_gib} GiB, load {os.getloadavg()[0]:.1f}, "
          f"page cache {'dropped' if os.geteuid() == 0 else 'kept (not root)'}\n")
    print(markdown_table(["measure", "figure", "ratio", "target"], rows))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 GiB")
    p.add_argument("--size-gib", type=int, default=None, help="the volume's size (default 16, --quick 2)")
    p.add_argument("--radosgw", type=int, default=0, metavar="GIB",
                   help="also upload and restore GIB GiB to and from a RADOS Gateway (starts a single-node Ceph)")
    p.add_argument("--work-dir", default=None, help="where the volume and the store go (default: the system's "
                   "temporary directory)")
    args = p.parse_args(argv)
    if args.size_gib is None:
        args.size_gib = 2 if args.quick else 16
    return args


if __name__ == "__main__":
    sys.exit(run(parse_args()))
