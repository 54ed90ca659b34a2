"""A tiny Linux guest for tests and demos: Debian's kernel, busybox, and a disk reporter.

``build_guest()`` makes (and caches) the kernel and initramfs; ``TestGuest`` boots them under QEMU
(TCG), reports virtio disks by serial as they are hot-plugged and runs shell commands in the guest::

    image = build_guest()
    with TestGuest("vm1", workdir, image, qmp_dir) as guest:
        guest.wait_ready()
        dev = guest.wait_for_disk("vol0123456789abcdef0")
        print(guest.write_pattern(dev, "seed", 4))

``build_guest(bench=True)`` is the bench flavour: the same guest with Debian's bonnie++ and ext2
(``bench_image``), which ``vbs.rigs.testguest.bonnie`` drives (bench/bonnie.py, the paper's (docs/architecture.md §1)
experiment), and Debian's fio on a read-only disk image beside it, which ``vbs.rigs.testguest.fio`` mounts
and runs (bench/guest_datapath.py). ``TestGuest(cpus=N)`` gives a guest N vCPUs (default one).
"""

from vbs.rigs.testguest.build import GuestImage, build_guest, default_cache_dir
from vbs.rigs.testguest.guest import TestGuest, pattern_bytes, pattern_sha256

__all__ = ["TestGuest", "build_guest", "GuestImage", "pattern_bytes", "pattern_sha256", "default_cache_dir"]
