"""Positional reads and writes of a volume's bytes: a file, a block device, an fd a caller opened.

Uploads read chunks from many threads at once and restores write them so; ``os.pread`` and
``os.pwrite`` share no file position, so one descriptor serves every thread.
"""

from __future__ import annotations

import os
import stat
from types import TracebackType
from typing import Protocol, runtime_checkable

from vbs.errors import DriverError

__all__ = ["VolumeReader", "VolumeWriter", "FileReader", "FileWriter", "Target"]

Target = str | os.PathLike[str] | int


@runtime_checkable
class VolumeReader(Protocol):
    def read_at(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset`` (a short read is an error)."""
        ...


@runtime_checkable
class VolumeWriter(Protocol):
    def write_at(self, offset: int, data: bytes) -> None: ...

    def flush(self) -> None:
        """Make everything written durable."""
        ...


class _Fd:
    def __init__(self, target: Target, flags: int, what: str) -> None:
        self._own = not isinstance(target, int)
        self.name = f"fd {target}" if isinstance(target, int) else str(target)
        try:
            self.fd = target if isinstance(target, int) else os.open(target, flags | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DriverError(f"cannot open {self.name} to {what}: {exc.strerror}") from None

    def close(self) -> None:
        if self._own and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> _Fd:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class FileReader(_Fd):
    """Reads of a path (opened and closed here) or of an fd the caller owns."""

    def __init__(self, target: Target) -> None:
        super().__init__(target, os.O_RDONLY, "read")

    def __enter__(self) -> FileReader:
        return self

    def read_at(self, offset: int, length: int) -> bytes:
        parts: list[bytes] = []
        done = 0
        while done < length:
            try:
                part = os.pread(self.fd, length - done, offset + done)
            except OSError as exc:
                raise DriverError(f"cannot read {self.name} at {offset + done}: {exc.strerror}") from None
            if not part:
                raise DriverError(f"{self.name} ends at {offset + done}, before the {length} bytes at {offset}")
            parts.append(part)
            done += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)


class FileWriter(_Fd):
    """Writes to a path or an fd. A regular file is made exactly ``size`` bytes long first; when this
    made it (it did not exist, or was empty) it is known to read as zeros, so zero chunks need no write."""

    def __init__(self, target: Target, size: int) -> None:
        super().__init__(target, os.O_WRONLY | os.O_CREAT, "write")
        try:
            st = os.fstat(self.fd)
            self.zeroed = False
            if stat.S_ISREG(st.st_mode):
                self.zeroed = st.st_size == 0
                os.ftruncate(self.fd, size)
        except OSError as exc:
            self.close()
            raise DriverError(f"cannot size {self.name} to {size} bytes: {exc.strerror}") from None

    def __enter__(self) -> FileWriter:
        return self

    def write_at(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as exc:
                raise DriverError(f"cannot write {self.name} at {offset}: {exc.strerror}") from None
            view, offset = view[n:], offset + n

    def flush(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise DriverError(f"cannot flush {self.name}: {exc.strerror}") from None

