"""An RBD image's bytes through the ``rbd`` tool's diff streams (docs/snapshots.md "RBD pools"): what the
snapshot store reads of an RBD snapshot and writes into a new image.

- **Reading** (``DiffReader``): ``rbd export-diff [--from-snap PREV] --whole-object IMAGE@SNAP -`` streams
  the snapshot's allocated objects (with ``--from-snap``: only those changed since PREV), in order of
  offset, in the ``rbd diff v1`` format; a clone's stream includes what it reads from its parents. The
  reader answers ``read_at`` from that one stream: bytes no record covers are zeros (a full stream), or
  unchanged since PREV (an incremental one: a read of them starts a full stream over). The upload asks
  for chunks in increasing order, a few at a time, so each record is read once and kept only until its
  chunks are taken.
- **Writing** (``DiffWriter``): ``rbd import-diff - IMAGE`` takes ``w`` records (offset, length, bytes) in
  any order and writes them into an existing image; the stream ends with ``e`` (a stream cut short makes
  the tool fail, so a restore that broke off is never taken for a complete one).

The tools run as children with the pool's argv (the cephx key stays in the keyring the conf names), a
minimal environment and no shell; a stream that stalls for ``timeout_s`` is an error, and the child is
stopped by its PID.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import os
import select
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from vbs.errors import DriverError
from vbs.system.processes import minimal_environment, stop_child

__all__ = ["DiffReader", "DiffWriter", "HEADER", "Record", "parse_records"]

log = logging.getLogger(__name__)

HEADER = b"rbd diff v1\n"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_EXTENT = struct.Struct("<QQ")
_MAX_NAME = 4096  # a snapshot name in a 'f' or 't' record
_MAX_RECORD = 1 << 30  # one 'w' record: an object is at most 32 MiB; a generous bound against a broken stream
STOP_S = 10.0
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_BYTES = 1 << 20


@dataclass(frozen=True)
class Record:
    """One extent of a diff stream: ``data`` (a ``w`` record), or None for zeros (``z``)."""

    offset: int
    length: int
    data: bytes | None

    @property
    def end(self) -> int:
        return self.offset + self.length


def _stopped(proc: subprocess.Popen[bytes], what: str) -> None:
    try:
        stop_child(proc, timeout=STOP_S, what=what)
    except DriverError as exc:
        log.warning("%s", exc.message)


def _tail(errors: IO[bytes]) -> str:
    errors.seek(0)
    lines = errors.read().decode(errors="replace").strip().splitlines()
    return (lines[-1] if lines else "")[:500]


class _Stream:
    """The stdout of one ``rbd export-diff`` child, read exactly, each read bounded by ``timeout_s``."""

    def __init__(self, argv: list[str], timeout_s: float, what: str) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        # Unbuffered: select() sees every byte not yet read (a buffer would hide some from it).
        self.proc = subprocess.Popen(argv, env=minimal_environment(), stdin=subprocess.DEVNULL,  # noqa: S603
                                     stdout=subprocess.PIPE, stderr=self._errors, bufsize=0)
        assert self.proc.stdout is not None
        self._out = self.proc.stdout
        with contextlib.suppress(OSError):  # a larger pipe: fewer, larger reads (a system call costs here)
            fcntl.fcntl(self._out.fileno(), F_SETPIPE_SZ, _PIPE_BYTES)

    def exact(self, n: int, *, eof_ok: bool = False) -> bytes:
        parts: list[bytes] = []
        left = n
        while left:
            ready, _, _ = select.select([self._out], [], [], self.timeout_s)
            if not ready:
                raise DriverError(f"{self.what}: no data for {self.timeout_s:g}s")
            part = self._out.read(min(left, _PIPE_BYTES))
            if not part:
                if eof_ok and left == n:
                    return b""
                raise DriverError(f"{self.what} ended in the middle of a record{self._failure()}")
            parts.append(part)
            left -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _failure(self) -> str:
        try:
            code = self.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            return ""
        return f" (exit {code}: {_tail(self._errors)})" if code else ""

    def finish(self) -> None:
        """The stream ended: the tool must exit 0."""
        try:
            code = self.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            raise DriverError(f"{self.what} did not exit after its stream ended") from None
        if code != 0:
            raise DriverError(f"{self.what} failed (exit {code}): {_tail(self._errors)}")

    def close(self) -> None:
        _stopped(self.proc, self.what)
        self._out.close()
        self._errors.close()


def parse_records(read: Callable[..., bytes], size: int) -> Record | None:
    """The next extent of a diff stream read through ``read(n, eof_ok=...)`` (header records skipped),
    or None at its end (``e``). Extents past ``size`` are refused."""
    while True:
        tag = read(1)
        if tag in (b"f", b"t"):
            (n,) = _U32.unpack(read(4))
            if n > _MAX_NAME:
                raise DriverError(f"rbd diff stream: a snapshot name of {n} bytes")
            read(n)
        elif tag == b"s":
            read(8)
        elif tag in (b"w", b"z"):
            offset, length = _EXTENT.unpack(read(16))
            if offset + length > size or length > _MAX_RECORD:
                raise DriverError(f"rbd diff stream: an extent {offset}+{length} past the image's {size} bytes")
            return Record(offset, length, read(length) if tag == b"w" else None)
        elif tag == b"e":
            return None
        else:
            raise DriverError(f"rbd diff stream: unknown record {tag!r}")


class DiffReader:
    """``read_at`` over the export-diff streams of one snapshot (``argv(since)``: the tool's argv, with
    ``--from-snap since`` unless None). ``since``: the snapshot the first stream starts from (None: a full
    stream); ``zero_from``: bytes from there on that an incremental stream leaves out are zeros (the end
    of ``since``: what a grown image added). The records read are kept up to ``keep_bytes`` of data,
    the oldest dropped first; a read of dropped bytes, or of bytes an incremental stream left out as
    unchanged, starts a full stream over (``streams`` counts them)."""

    def __init__(self, argv: Callable[[str | None], list[str]], size: int, *, since: str | None, zero_from: int,
                 timeout_s: float, what: str, keep_bytes: int = 32 << 20) -> None:
        self.size = size
        self._argv = argv
        self._timeout_s = timeout_s
        self._what = what
        self._keep = keep_bytes
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self.streams = 0
        self._start(since, zero_from)

    def _start(self, since: str | None, zero_from: int) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._since = since
        self._zero_from = zero_from if since is not None else 0
        self._records: list[Record] = []  # read and kept, by offset
        self._starts: list[int] = []
        self._kept = 0  # bytes of data kept
        self._frontier = 0  # every record starting before it has been read
        self._floor = 0  # the records ending at or before it may have been dropped
        self._ended = False
        self._stream = _Stream(self._argv(since), self._timeout_s, self._what)
        self.streams += 1
        if self._stream.exact(len(HEADER)) != HEADER:
            raise DriverError(f"{self._what}: not an rbd diff v1 stream")

    def _next(self) -> None:
        assert self._stream is not None
        record = parse_records(self._stream.exact, self.size)
        if record is None:
            self._stream.finish()
            self._ended = True
            return
        if record.offset < self._frontier:
            raise DriverError(f"{self._what}: extents out of order at {record.offset}")
        self._frontier = record.end
        if not record.length:
            return
        self._records.append(record)
        self._starts.append(record.offset)
        self._kept += len(record.data or b"")
        while self._kept > self._keep and len(self._records) > 1:
            old = self._records.pop(0)
            self._starts.pop(0)
            self._kept -= len(old.data or b"")
            self._floor = old.end

    def read_at(self, offset: int, length: int) -> bytes:
        end = offset + length
        if offset < 0 or length < 0 or end > self.size:
            raise DriverError(f"{self._what}: a read of {length} bytes at {offset} is past the image's end")
        with self._lock:
            if offset < self._floor:
                self._start(None, 0)  # behind what is kept
            while not self._ended and self._frontier < end:
                self._next()
            if not self._covered(offset, end):
                self._start(None, 0)  # unchanged since ``since``: this stream does not have it
                while not self._ended and self._frontier < end:
                    self._next()
            return self._assemble(offset, end)

    def _overlapping(self, offset: int, end: int) -> list[Record]:
        k = max(0, bisect.bisect_right(self._starts, offset) - 1)
        found: list[Record] = []
        for record in self._records[k:]:
            if record.offset >= end:
                break
            if record.end > offset:
                found.append(record)
        return found

    def _covered(self, offset: int, end: int) -> bool:
        """Whether the stream gives every byte of [offset, end): a full one does (zeros where no record
        is); an incremental one leaves out what did not change, before ``zero_from``."""
        if self._since is None:
            return True
        pos, limit = offset, min(end, self._zero_from)
        for record in self._overlapping(offset, end):
            if record.offset > pos and pos < limit:
                return False
            pos = max(pos, record.end)
        return pos >= limit

    def _assemble(self, offset: int, end: int) -> bytes:
        out = bytearray(end - offset)
        for record in self._overlapping(offset, end):
            if record.data is not None:
                lo, hi = max(offset, record.offset), min(end, record.end)
                out[lo - offset:hi - offset] = record.data[lo - record.offset:hi - record.offset]
        return bytes(out)

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


class DiffWriter:
    """``write_at`` into an existing image through one ``rbd import-diff`` child (``argv``); ``flush``
    ends the stream and waits for the tool to have written everything."""

    def __init__(self, argv: list[str], *, timeout_s: float, what: str) -> None:
        self._what = what
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(argv, env=minimal_environment(), stdin=subprocess.PIPE,  # noqa: S603
                                      stdout=subprocess.DEVNULL, stderr=self._errors, bufsize=0)
        assert self._proc.stdin is not None
        self._in = self._proc.stdin
        os.set_blocking(self._in.fileno(), False)  # each write waits at most ``timeout_s`` (select)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._in.fileno(), F_SETPIPE_SZ, _PIPE_BYTES)
        self._send(HEADER)
        self.zeroed = True  # a new image reads as zeros

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            _, ready, _ = select.select([], [self._in], [], self._timeout_s)
            if not ready:
                raise DriverError(f"{self._what} took no data for {self._timeout_s:g}s")
            try:
                view = view[os.write(self._in.fileno(), view):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ValueError):
                raise DriverError(f"{self._what} stopped taking data{self._failure()}") from None

    def _failure(self) -> str:
        try:
            code = self._proc.wait(self._timeout_s)
        except subprocess.TimeoutExpired:
            return ""
        return f" (exit {code}: {_tail(self._errors)})"

    def write_at(self, offset: int, data: bytes) -> None:
        if data.count(0) == len(data):
            return  # the new image reads as zeros there already
        with self._lock:
            self._send(b"w" + _EXTENT.pack(offset, len(data)))
            self._send(data)

    def flush(self) -> None:
        with self._lock:
            self._send(b"e")
            try:
                self._in.close()
            except BrokenPipeError:
                pass
            try:
                code = self._proc.wait(self._timeout_s)
            except subprocess.TimeoutExpired:
                raise DriverError(f"{self._what} did not finish within {self._timeout_s:g}s of its stream's end") \
                    from None
            if code != 0:
                raise DriverError(f"{self._what} failed (exit {code}): {_tail(self._errors)}")

    def close(self) -> None:
        _stopped(self._proc, self._what)
        if not self._in.closed:
            try:
                self._in.close()
            except BrokenPipeError:
                pass
        self._errors.close()
