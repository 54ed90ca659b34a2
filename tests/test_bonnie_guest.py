"""bonnie++ in the bench test guest on an ext2 filesystem on a VBS volume over NBD: the tool chain of
bench/bonnie.py (the guest image's bonnie++, its libraries and ext2 driver; the console channel;
the parse of bonnie++'s CSV line). Tiny sizes: a proof that it runs, not a measurement."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import Vbs, VbsUp
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.rigs.testguest.bonnie import PAPER_COLUMNS, BonnieSize, mount_ext2, run_bonnie, unmount

pytestmark = pytest.mark.integration

EXT2_MAGIC_OFFSET = 1080  # the superblock starts at 1024; s_magic (0xEF53) is 56 bytes in


@pytest.fixture(scope="module")
def nbd_guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vbs, TestGuest]]:
    tmp = tmp_path_factory.mktemp("bonnie")
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--export", "nbd"])
    guest = TestGuest("vm1", tmp / "guest", build_guest(bench=True), tmp / "var" / "vms", memory_mib=128)
    try:
        guest.start()  # boots while vbs up starts
        vbs = up.start()
        guest.wait_ready(300)
        yield vbs, guest
    finally:
        guest.stop()
        up.stop()


def test_bonnie_runs_on_ext2_on_a_vbs_nbd_volume_and_its_csv_gives_the_paper_figures(
    nbd_guest: tuple[Vbs, TestGuest],
) -> None:
    vbs, guest = nbd_guest
    volume_id = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(volume_id, "available")
    vbs.cli("attach-volume", volume_id, "--host", "host-1", "--vm", "vm1", "--wait")
    dev = guest.wait_for_disk(virtio_serial(volume_id), 60)

    mount_ext2(guest, dev, "/mnt/vol")
    assert f"/dev/{dev} /mnt/vol ext2 " in guest.check("cat /proc/mounts")
    # -r 8 lets bonnie++ take a 16 MiB file in a 128 MiB guest.
    result = run_bonnie(guest, "/mnt/vol", BonnieSize(file_mib=16, ram_mib=8, files_k=1), "smoke", timeout=1800)
    unmount(guest, "/mnt/vol")

    assert (result.label, result.file_size) == ("smoke", "16M")
    # Per-character I/O is CPU-bound under TCG: never too quick for bonnie++ to time.
    assert result.putc_kib_s is not None and result.putc_kib_s > 0
    assert result.getc_kib_s is not None and result.getc_kib_s > 0
    timed = [value for _, name in PAPER_COLUMNS if (value := getattr(result, name)) is not None]
    assert all(value > 0 for value in timed)
    # bonnie++ cleaned up after itself, and the filesystem it ran on is on the VBS volume.
    assert guest.check(f"mount -t ext2 /dev/{dev} /mnt/vol && ls -A /mnt/vol && umount /mnt/vol").split() == [
        "lost+found"
    ]
    magic = guest.check(f"dd if=/dev/{dev} bs=1 skip={EXT2_MAGIC_OFFSET} count=2 2>/dev/null | od -An -tx2")
    assert magic.split() == ["ef53"]
