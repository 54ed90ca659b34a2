"""A host's local pool (the file backend, built as the host agent builds it) and its copies to and from a
storage node's real NBD export over TLS-PSK: filled from a shared volume's export, copied out into another,
with qemu-img opening the export through the same host connector a VM's disk uses."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.export_fixtures import MiB, drivers_of
from vbs.config import HostAgentConfig, PoolConfig
from vbs.errors import IncorrectState, NotFound
from vbs.host.local_pools import CopyCredentials, LocalPools, build_local_pools
from vbs.pools.exports import FileSource
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.storage import ItemStatus

pytestmark = pytest.mark.integration

HOST = HostIdentity(name="host-1", address="127.0.0.1")
LOCAL = "vol-0a0a0a0a0a0a0a0a0"
SHARED = "vol-0b0b0b0b0b0b0b0b0"
BACK = "vol-0c0c0c0c0c0c0c0c0"
SNAP = "snap-0d0d0d0d0d0d0d0d0"


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, "qemu-storage-daemon")


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalPools]:
    (tmp_path / "local").mkdir()
    cfg = HostAgentConfig(local_pools=[PoolConfig(name="local", path=tmp_path / "local")])
    pools = LocalPools(build_local_pools(cfg), CopyCredentials(tmp_path / "secrets"))
    yield pools
    pools.close()


def until_ready(call: Callable[[], ItemStatus]) -> ItemStatus:
    deadline = time.monotonic() + 60
    while (status := call()).state == "copying":
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    return status


def test_a_local_volume_is_filled_from_and_copied_back_to_tls_exports(
        make_driver: Callable[..., NbdExportDriver], local: LocalPools, tmp_path: Path) -> None:
    data = os.urandom(3 * MiB)
    shared = tmp_path / "shared.raw"
    shared.write_bytes(data + bytes(13 * MiB))
    back = tmp_path / "back.raw"
    back.write_bytes(bytes(16 * MiB))
    drv = make_driver(tls=True)
    drv.start()
    source = drv.ensure_export(SHARED, FileSource(shared), HOST, read_only=True)
    assert isinstance(source, NbdConnection) and source.tls == "psk"

    assert local.pool("local").ensure_volume(LOCAL, 16 * MiB).state == "ready"
    filled = until_ready(lambda: local.fill("local", LOCAL, source))
    assert filled.state == "ready", filled.error
    path = local.path_of("local", LOCAL)
    assert path.read_bytes()[:3 * MiB] == data and path.stat().st_size == 16 * MiB
    local.remove_copy(LOCAL)
    assert not list((tmp_path / "secrets").rglob("keys.psk"))  # the key file lived while qemu-img started

    target = drv.ensure_export(BACK, FileSource(back), HOST)
    copied = until_ready(lambda: local.copy_out("local", LOCAL, SNAP, target))
    assert copied.state == "ready", copied.error
    assert back.read_bytes()[:3 * MiB] == data


def test_a_failed_copy_says_why_and_a_repeat_starts_it_again(local: LocalPools, tmp_path: Path) -> None:
    local.pool("local").ensure_volume(LOCAL, 16 * MiB)
    nowhere = NbdConnection(socket=str(tmp_path / "none.sock"), export=SHARED)
    failed = until_ready(lambda: local.fill("local", LOCAL, nowhere))
    assert failed.state == "error" and failed.error is not None and "qemu-img convert failed" in failed.error
    # The error was answered once; a repeat runs the copy again (and fails again, for the same reason).
    again = until_ready(lambda: local.fill("local", LOCAL, nowhere))
    assert again.state == "error" and again.error == failed.error


def test_a_local_pool_serves_no_export_and_knows_only_its_own_pools(local: LocalPools) -> None:
    local.pool("local").ensure_volume(LOCAL, MiB)
    with pytest.raises(IncorrectState, match="own host only"):
        local.pool("local").connection_for(LOCAL, HOST)
    with pytest.raises(NotFound, match="no local pool named"):
        local.path_of("other", LOCAL)


def test_a_fill_reports_its_progress_as_qemu_img_copies(local: LocalPools, tmp_path: Path) -> None:
    """A storage node whose export is throttled to 8 MB/s: a 24 MiB fill takes seconds, its progress climbs."""
    shared = tmp_path / "slow.raw"
    shared.write_bytes(os.urandom(24 * MiB))
    sock = tmp_path / "slow.sock"
    qsd = subprocess.Popen(
        ["qemu-storage-daemon", "--object", "throttle-group,id=tg,x-bps-total=8000000",
         "--blockdev", f"driver=file,node-name=f0,filename={shared}",
         "--blockdev", "driver=throttle,node-name=t0,throttle-group=tg,file=f0",
         "--nbd-server", f"addr.type=unix,addr.path={sock}",
         "--export", f"type=nbd,id=e0,node-name=t0,name={SHARED}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert qsd.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        local.pool("local").ensure_volume(LOCAL, 24 * MiB)
        source = NbdConnection(socket=str(sock), export=SHARED)
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while (status := local.fill("local", LOCAL, source)).state == "copying":
            seen.append(status.progress)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status.state == "ready", status.error
        assert seen == sorted(seen) and any(0 < p < 100 for p in seen), seen
        assert local.path_of("local", LOCAL).read_bytes() == shared.read_bytes()
    finally:
        qsd.terminate()
        qsd.wait(10)
