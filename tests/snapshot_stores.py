"""What the snapshot store tests share: a store of each driver (a directory; an S3 bucket on moto's S3
server on a free loopback port, and one on a real RADOS Gateway of the session's Ceph cluster), a store
that counts and intercepts calls, and volumes of known bytes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.ceph_cluster import RadosGatewayForTests
from tests.export_fixtures import write_at
from vbs.snapshot_store.contract import BatchingStore, ObjectInfo, SnapshotStore, StoreBatch, Trusted, Whole, open_batch
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.gc_runs import CLOCK_SKEW_S
from vbs.snapshot_store.keys import StoreKey
from vbs.snapshot_store.s3 import S3Store, read_credentials
from vbs.wire.storage import ItemStatus

__all__ = ["moto_endpoint", "store", "Recording", "make_volume", "MiB", "FAKE_SECRET", "KEY", "ACME", "SNAP", "VOL",
           "pattern", "write_at", "sha", "flip_last_byte", "a_minute_later", "syncs_per_batch"]

_Found = TypeVar("_Found")

MiB = 1024 * 1024
# One store key for the tests, its tenant acme's key, snapshot ids in order, and a volume id.
KEY = StoreKey(bytes(range(32)))
ACME = KEY.tenant_key("acme")
SNAP = [f"snap-{i:017x}" for i in range(1, 10)]
VOL = "vol-0000000000000000a"
# moto accepts any key; this one must never show up in anything a store prints.
FAKE_SECRET = "s3cr3t-" + "x" * 33


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, on a port the OS picked; stopped at the end of the session."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@functools.cache
def _admin(endpoint: str, credentials: Path) -> Any:
    """One client per server to make buckets with (a boto3 client takes a while to make)."""
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        **read_credentials(credentials, "default"))


def moto_credentials(tmp_path: Path) -> Path:
    """A 0600 credentials file with a key moto accepts (any key)."""
    creds = tmp_path / "s3-credentials"
    creds.write_text(f"[default]\naws_access_key_id = AKIAVBSTEST\naws_secret_access_key = {FAKE_SECRET}\n")
    creds.chmod(0o600)
    return creds


def new_bucket(endpoint: str, credentials: Path) -> str:
    """A new, empty bucket on ``endpoint``: its name."""
    bucket = f"vbs-{secrets.token_hex(6)}"
    _admin(endpoint, credentials).create_bucket(Bucket=bucket)
    return bucket


def s3_store(endpoint: str, tmp_path: Path, prefix: str = "vbs", credentials: Path | None = None) -> S3Store:
    """A new bucket on ``endpoint`` and a store in it, its credentials in a 0600 file (moto's made up
    unless ``credentials`` is given)."""
    creds = credentials or moto_credentials(tmp_path)
    bucket = new_bucket(endpoint, creds)
    return S3Store.from_config({"endpoint_url": endpoint, "bucket": bucket, "prefix": prefix,
                                "region": "us-east-1", "credentials_file": str(creds)}, default_dir=tmp_path)


# The S3 half talks HTTP to an S3 server (moto's, started once a session; a RADOS Gateway on the session's
# Ceph cluster), so it is of the integration tier, as the PostgreSQL half of a database test is; the unit
# tier runs the same tests on the dir store.
@pytest.fixture(params=["dir", pytest.param("s3", marks=pytest.mark.integration),
                        pytest.param("radosgw", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> SnapshotStore:
    """The same tests against each driver."""
    if request.param == "dir":
        return DirStore.from_config({}, default_dir=tmp_path / "snapshots")
    if request.param == "radosgw":
        gateway: RadosGatewayForTests = request.getfixturevalue("radosgw")
        return s3_store(gateway.endpoint, tmp_path, credentials=gateway.credentials)
    endpoint: str = request.getfixturevalue("moto_endpoint")
    return s3_store(endpoint, tmp_path)


class Recording:
    """A store that counts every call by name and key kind, and can run a hook after a call
    (``after["has"] = fn(key, result)``), fail one (``fail_put_after = N``: the N+1th chunk put raises)
    or hold chunk puts until ``hold_puts_until`` of them are in flight at once (10 s at most)."""

    name = "recording"

    def __init__(self, inner: SnapshotStore) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.keys: dict[str, list[str]] = {}
        self.order: list[str] = []  # "call kind" of every call, in order
        self.after: dict[str, Callable[[str, Any], None]] = {}
        self.fail_put_after: int | None = None
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold_puts_until = 0

    @classmethod
    def from_config(cls, options: Mapping[str, Any], *, default_dir: Path) -> Recording:
        raise NotImplementedError

    def _note(self, call: str, key: str) -> None:
        with self._lock:
            kind = key.split("/", 1)[0]
            self.calls[f"{call} {kind}"] += 1
            self.order.append(f"{call} {kind}")
            self.keys.setdefault(f"{call} {kind}", []).append(key)

    def _hook(self, call: str, key: str, result: Any) -> None:
        hook = self.after.get(call)
        if hook is not None:
            hook(key, result)

    def describe(self) -> str:
        return self.inner.describe()

    def put(self, key: str, data: bytes) -> None:
        self._put(key, data, self.inner.put)

    def batch(self, trust_before: float) -> RecordingBatch:
        return RecordingBatch(self, open_batch(self.inner, lambda: trust_before))

    def _put(self, key: str, data: bytes, put: Callable[[str, bytes], None]) -> None:
        chunk = key.startswith("chunks/")
        with self._lock:
            if self.fail_put_after is not None and chunk:
                if self.fail_put_after <= 0:
                    raise OSError("simulated crash")
                self.fail_put_after -= 1
            if chunk:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                self._moved.notify_all()
                self._moved.wait_for(lambda: self.max_in_flight >= self.hold_puts_until, timeout=10)
        try:
            put(key, data)
        finally:
            if chunk:
                with self._lock:
                    self.in_flight -= 1
        self._note("put", key)
        self._hook("put", key, data)

    def get(self, key: str) -> bytes:
        self._note("get", key)
        return self.inner.get(key)

    def head(self, key: str) -> ObjectInfo | None:
        self._note("head", key)
        return self.inner.head(key)

    def has(self, key: str) -> bool:
        return self._has(key, self.inner.has)

    def _has(self, key: str, has: Callable[[str], _Found]) -> _Found:
        self._note("has", key)
        result = has(key)
        self._hook("has", key, result)
        return result

    def delete(self, key: str) -> None:
        self._note("delete", key)
        self.inner.delete(key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._note("list", prefix or "/")
        return self.inner.list(prefix)

    def count(self, call: str, kind: str = "chunks") -> int:
        return self.calls[f"{call} {kind}"]


class RecordingBatch:
    """A batch of the recording store's inner one, its puts and lookups counted (and failed, held or
    hooked) as the store's own are; ``commits`` counts its commits."""

    def __init__(self, recording: Recording, inner: StoreBatch) -> None:
        self.recording = recording
        self.inner = inner

    def put(self, key: str, data: bytes) -> None:
        self.recording._put(key, data, self.inner.put)

    def trusted(self, key: str, whole: Whole) -> Trusted | None:
        return self.recording._has(key, functools.partial(self.inner.trusted, whole=whole))

    def commit(self) -> None:
        self.recording._note("commit", "batch")
        self.inner.commit()


def make_volume(path: Path, size: int, *, seed: int = 1, zero_ranges: tuple[tuple[int, int], ...] = ()) -> bytes:
    """A sparse file of ``size`` random bytes (from ``seed``) with ``zero_ranges`` (offset, length) left
    as holes; returns its bytes."""
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(size))
    for offset, length in zero_ranges:
        data[offset:offset + length] = bytes(min(length, size - offset))
    with open(path, "wb") as f:
        f.truncate(size)
        pos = 0
        for offset, length in sorted(zero_ranges) + [(size, 0)]:
            if offset > pos:
                f.seek(pos)
                f.write(data[pos:offset])
            pos = max(pos, offset + length)
    os.chmod(path, 0o600)
    return bytes(data)


def pattern(seed: bytes, mib: int) -> bytes:
    """``mib`` MiB of bytes no other seed (or other MiB of this one) has: every chunk is its own."""
    return random.Random(seed).randbytes(mib * MiB)


def syncs_per_batch(store: SnapshotStore) -> bool:
    """Whether ``store`` makes an upload's chunks durable at its commit (a ``dir`` store), and so trusts
    a chunk it holds unread only if it was put before every upload in flight began, a younger one once
    read back whole (docs/snapshots.md, "Durability")."""
    return isinstance(store, BatchingStore)


def a_minute_later(store: SnapshotStore) -> None:
    """Make every chunk of a ``dir`` store look put two minutes ago (as they would once that much time
    has gone by): older than the clocks' skew, so an upload that starts now trusts them."""
    if isinstance(store, DirStore):
        then = time.time() - 2 * CLOCK_SKEW_S
        for path in (store.root / "chunks").rglob("*"):
            if path.is_file():
                os.utime(path, (then, then))


def flip_last_byte(path: Path) -> None:
    """Corrupt a stored object (a chunk file of a dir store) the way bit rot would: its last byte flipped."""
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))


S = TypeVar("S", bound=ItemStatus)


def until(get: Callable[[], S], timeout: float = 300.0) -> S:
    """``get()`` again until what it answers is no longer ``copying`` (an agent's upload or restore)."""
    deadline = time.monotonic() + timeout
    while (status := get()).state == "copying":
        assert time.monotonic() < deadline, "still copying"
        time.sleep(0.05)
    return status


def sha(path: Path, length: int | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        left = length if length is not None else path.stat().st_size
        while left > 0:
            block = fh.read(min(8 * MiB, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()
