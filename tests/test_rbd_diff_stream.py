"""The ``rbd diff v1`` streams of the rbd backend's snapshot store side (``rbd_diff``), fed by ``cat`` of
streams written here in the tool's format (unit tier; tests/test_rbd_snapshot_store.py reads and writes
real images through ``rbd export-diff`` and ``rbd import-diff``).

Reads answer from one stream in order; bytes a full stream leaves out are zeros; bytes an incremental
stream leaves out as unchanged, or bytes already dropped, start a full stream over; a stream cut short,
out of order or past the image's end is an error, never data.
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest

from vbs.errors import DriverError
from vbs.storage.backends.rbd_diff import HEADER, DiffReader, DiffWriter, parse_records

pytestmark = pytest.mark.unit

MiB = 1 << 20
SIZE = 16 * MiB


def stream(path: Path, records: list[tuple[bytes, int, bytes | int]], *, end: bool = True) -> Path:
    """A diff stream: ``(b"w", offset, data)`` and ``(b"z", offset, length)`` records after the header
    records the tool writes (from/to snapshot names, the size)."""
    out = io.BytesIO()
    out.write(HEADER + b"f" + struct.pack("<I", 2) + b"s1" + b"t" + struct.pack("<I", 2) + b"s2")
    out.write(b"s" + struct.pack("<Q", SIZE))
    for tag, offset, body in records:
        if isinstance(body, bytes):
            out.write(tag + struct.pack("<QQ", offset, len(body)) + body)
        else:
            out.write(tag + struct.pack("<QQ", offset, body))
    if end:
        out.write(b"e")
    path.write_bytes(out.getvalue())
    return path


def reader(full: Path, incremental: Path | None = None, *, zero_from: int = SIZE, keep: int = 32 * MiB) -> DiffReader:
    def argv(since: str | None) -> list[str]:
        return ["cat", str(incremental if since is not None and incremental is not None else full)]

    return DiffReader(argv, SIZE, since="s1" if incremental is not None else None, zero_from=zero_from,
                      timeout_s=30, what="test stream", keep_bytes=keep)


def test_a_full_stream_answers_reads_in_order_with_zeros_between_its_records(tmp_path: Path) -> None:
    a, b = os.urandom(2 * MiB), os.urandom(MiB)
    r = reader(stream(tmp_path / "full", [(b"w", MiB, a), (b"z", 4 * MiB, MiB), (b"w", 12 * MiB, b)]))
    image = bytes(MiB) + a + bytes(9 * MiB) + b + bytes(3 * MiB)
    try:
        assert [r.read_at(i * MiB, MiB) for i in range(16)] == [image[i * MiB:(i + 1) * MiB] for i in range(16)]
        assert r.streams == 1
        assert r.read_at(MiB, MiB) == a[:MiB], "kept data is read again without a new stream"
        assert r.streams == 1
    finally:
        r.close()


def test_an_incremental_stream_starts_a_full_one_for_unchanged_bytes_only(tmp_path: Path) -> None:
    old, new = os.urandom(4 * MiB), os.urandom(4 * MiB)
    full = stream(tmp_path / "full", [(b"w", 0, old[:2 * MiB] + new[:MiB] + old[3 * MiB:]), (b"w", 8 * MiB, new)])
    incremental = stream(tmp_path / "inc", [(b"w", 8 * MiB, new)])
    r = reader(full, incremental, zero_from=12 * MiB)
    try:
        assert r.read_at(8 * MiB, MiB) == new[:MiB] and r.streams == 1
        assert r.read_at(13 * MiB, MiB) == bytes(MiB), "past the earlier snapshot's end: zeros"
        assert r.streams == 1
        assert r.read_at(2 * MiB, MiB) == new[:MiB], "unchanged bytes come from a full stream"
        assert r.streams == 2
    finally:
        r.close()


def test_bytes_dropped_from_what_is_kept_are_read_again_from_a_new_stream(tmp_path: Path) -> None:
    parts = [os.urandom(MiB) for _ in range(4)]
    r = reader(stream(tmp_path / "full", [(b"w", i * 4 * MiB, p) for i, p in enumerate(parts)]), keep=MiB)
    try:
        assert r.read_at(12 * MiB, MiB) == parts[3]
        assert r.read_at(0, MiB) == parts[0] and r.streams == 2
    finally:
        r.close()


@pytest.mark.parametrize(("records", "end", "message"), [
    ([(b"w", 0, b"x" * 10)], False, "ended in the middle"),
    ([(b"w", 4 * MiB, b"x" * 10), (b"w", 0, b"y" * 10)], True, "out of order"),
    ([(b"z", SIZE - 512, 4096)], True, "past the image"),
])
def test_a_broken_stream_is_an_error(tmp_path: Path, records: list[tuple[bytes, int, bytes | int]], end: bool,
                                     message: str) -> None:
    r = reader(stream(tmp_path / "bad", records, end=end))
    try:
        with pytest.raises(DriverError, match=message):
            for i in range(16):
                r.read_at(i * MiB, MiB)
    finally:
        r.close()


def test_the_writer_sends_non_zero_writes_and_the_end(tmp_path: Path) -> None:
    out = tmp_path / "sent"
    data = os.urandom(MiB)
    writer = DiffWriter(["tee", str(out)], timeout_s=30, what="test writer")  # what it is sent, into a file
    try:
        writer.write_at(3 * MiB, data)
        writer.write_at(5 * MiB, bytes(MiB))  # zeros: a new image has them
        writer.flush()
    finally:
        writer.close()
    sent = io.BytesIO(out.read_bytes())
    assert sent.read(len(HEADER)) == HEADER

    def read(n: int, eof_ok: bool = False) -> bytes:
        return sent.read(n)

    record = parse_records(read, SIZE)
    assert record is not None and record.offset == 3 * MiB and record.data == data
    assert parse_records(read, SIZE) is None and sent.read() == b""


def test_a_writer_whose_tool_stops_taking_data_fails_instead_of_hanging() -> None:
    writer = DiffWriter(["sleep", "600"], timeout_s=1, what="test writer")  # never reads its stdin
    try:
        with pytest.raises(DriverError, match="took no data"):
            for k in range(64):
                writer.write_at(k * 4 * MiB, os.urandom(4 * MiB))
    finally:
        writer.close()  # the child is stopped by its PID
    assert writer._proc.poll() is not None
