"""The sparse copy engine (``vbs.storage.copy.sparse_copy``) on the real file system of tmp_path.

It copies only data extents, in chunks, with write-behind and one fdatasync at the end: the copy
must read back identical, keep the source's holes, report progress as it goes and stop between
chunks when cancelled.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbs.storage.copy import CopyCancelled, CopyJob, data_ranges, sparse_copy, sparsify

MiB = 1 << 20
CHUNK = MiB


def write_at(path: Path, offset: int, length: int, seed: int) -> None:
    block = hashlib.sha256(str(seed).encode()).digest() * (MiB // 32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for at in range(0, length, MiB):
            os.pwrite(fd, block[:min(MiB, length - at)], offset + at)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture
def sparse_source(tmp_path: Path) -> Path:
    """64 MiB apparent, three data extents (one straddling chunk boundaries), the rest holes."""
    src = tmp_path / "src.raw"
    src.touch()
    os.truncate(src, 64 * MiB)
    write_at(src, 0, 3 * MiB, seed=1)
    write_at(src, 20 * MiB + 4096, 5 * MiB, seed=2)
    write_at(src, 63 * MiB, MiB, seed=3)
    return src


@pytest.fixture
def fds(sparse_source: Path, tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    dst = tmp_path / "dst.raw"
    src_fd = os.open(sparse_source, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        yield src_fd, dst_fd, dst
    finally:
        os.close(dst_fd)
        os.close(src_fd)


def test_the_copy_reads_back_identical_and_keeps_the_holes(sparse_source: Path,
                                                           fds: tuple[int, int, Path]) -> None:
    src_fd, dst_fd, dst = fds

    copied = sparse_copy(src_fd, dst_fd, chunk_bytes=CHUNK)

    assert sha256(dst) == sha256(sparse_source)
    data = sum(end - start for start, end in data_ranges(src_fd, 64 * MiB))
    assert copied == data
    assert dst.stat().st_size == 64 * MiB
    # Only the data is allocated (block-rounded): the holes stayed holes.
    assert dst.stat().st_blocks * 512 <= data + 3 * 4096
    assert list(data_ranges(dst_fd, 64 * MiB)) == list(data_ranges(src_fd, 64 * MiB))


def test_the_copy_is_sized_up_to_the_requested_size_with_a_hole(sparse_source: Path,
                                                                fds: tuple[int, int, Path]) -> None:
    src_fd, dst_fd, dst = fds

    sparse_copy(src_fd, dst_fd, size_bytes=80 * MiB, chunk_bytes=CHUNK)

    assert dst.stat().st_size == 80 * MiB
    with dst.open("rb") as f:
        assert f.read(64 * MiB) == sparse_source.read_bytes()
        assert f.read() == bytes(16 * MiB)


def test_progress_rises_chunk_by_chunk_to_the_data_bytes(fds: tuple[int, int, Path]) -> None:
    src_fd, dst_fd, _ = fds
    seen: list[tuple[int, int]] = []

    sparse_copy(src_fd, dst_fd, chunk_bytes=CHUNK, progress=lambda done, total: seen.append((done, total)))

    totals = {total for _, total in seen}
    assert len(totals) == 1
    total = totals.pop()
    done = [d for d, _ in seen]
    assert done[0] == 0 and done[-1] == total
    assert done == sorted(done)
    assert len(done) >= total // CHUNK  # at least one report per chunk, not one per extent
    assert all(b - a <= CHUNK for a, b in zip(done, done[1:], strict=False))


def test_a_set_cancel_stops_the_copy_between_chunks(fds: tuple[int, int, Path]) -> None:
    src_fd, dst_fd, _ = fds
    cancel = threading.Event()
    seen: list[int] = []

    def progress(done: int, _total: int) -> None:
        seen.append(done)
        if done >= 2 * CHUNK:
            cancel.set()

    with pytest.raises(CopyCancelled):
        sparse_copy(src_fd, dst_fd, chunk_bytes=CHUNK, cancel=cancel, progress=progress)

    assert seen[-1] == 2 * CHUNK  # not one chunk more after the cancel


def test_a_copy_job_cancelled_midway_ends_cancelled_and_leaves_its_file_to_its_owner(
        sparse_source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "job.raw"
    job = CopyJob(os.open(sparse_source, os.O_RDONLY), dst, 64 * MiB, chunk_bytes=CHUNK)
    job.cancel()  # before it starts: it must stop at its first chunk
    job.start()

    assert job.wait(60)
    assert job.state == "cancelled"
    assert dst.exists()  # the owner removes a cancelled copy's file


def test_a_copy_job_reports_done_and_a_complete_copy(sparse_source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "job.raw"
    job = CopyJob(os.open(sparse_source, os.O_RDONLY), dst, 64 * MiB, chunk_bytes=CHUNK)
    job.start()

    assert job.wait(60)
    assert (job.state, job.progress, job.error) == ("done", 100, None)
    assert sha256(dst) == sha256(sparse_source)
    assert job.done_bytes == job.total_bytes > 0


@pytest.mark.parametrize("seed", range(12))
def test_sparsify_punches_every_whole_zero_block_in_runs_and_changes_no_byte(tmp_path: Path, seed: int) -> None:
    """A copy made by someone else (an iSCSI target writes zeros as data) gives back the space of each
    aligned 64 KiB block of zeros, a run of them in one fallocate, and reads back unchanged."""
    rnd = random.Random(seed)
    block = 64 * 1024
    content = bytearray()
    for _ in range(rnd.randint(1, 40)):
        kind = rnd.choice(["zeros", "data", "one byte"])
        part = bytearray(os.urandom(block) if kind == "data" else bytes(block))
        if kind == "one byte":
            part[rnd.randrange(block)] = 1
        content += part
    content += bytes(rnd.choice([0, 100, block // 2]))  # a tail shorter than a block stays
    path = tmp_path / "copy"
    path.write_bytes(bytes(content))
    fd = os.open(path, os.O_RDWR)
    try:
        punched = sparsify(fd, scan_data=True)
        assert os.pread(fd, len(content) + 1, 0) == bytes(content)
        zero_blocks = sum(block for at in range(0, len(content) - block + 1, block)
                          if content[at:at + block] == bytes(block))
        assert punched == zero_blocks
        assert len(content) - sum(end - start for start, end in data_ranges(fd, len(content))) >= zero_blocks
    finally:
        os.close(fd)
