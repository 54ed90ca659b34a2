"""Numbered blocks a guest writes while VBS moves or copies its disk, and how a test finds them again.

Block ``i`` carries ``VBS-BLOCK-<i>`` and lands at slot ``i * stride % slots`` (a stride prime to
``slots`` gives every block its own slot); each write is durable (``fsync``, ``O_DIRECT``) before the
next starts, so the set of blocks a file holds says which instant it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MARK = re.compile(rb"VBS-BLOCK-(\d{8})\n")


@dataclass(frozen=True)
class NumberedBlocks:
    writes: int
    slots: int
    stride: int
    block: int = 4096

    @property
    def span_bytes(self) -> int:
        """The bytes at the start of the volume the slots cover."""
        return self.slots * self.block

    def slot(self, i: int) -> int:
        return i * self.stride % self.slots

    def writer_script(self, dev: str, progress: str | None = None) -> str:
        """A guest shell loop writing blocks 0..writes-1 in order, each durable before the next starts;
        with ``progress``, that file holds how many are durable after each one."""
        note = f"echo $i > {progress}; " if progress else ""
        return (f"i=0; while [ $i -lt {self.writes} ]; do "
                f"s=$(( i * {self.stride} % {self.slots} )); "
                "printf 'VBS-BLOCK-%08d\\n' $i > /run/blk; "
                f"dd if=/run/blk of=/dev/{dev} bs={self.block} seek=$s conv=sync,notrunc,fsync oflag=direct "
                f"2>/dev/null || exit 1; i=$((i+1)); {note}done; echo wrote $i")

    def blocks_in(self, path: Path) -> set[int]:
        """The numbered blocks a volume or snapshot file holds, each at its own slot."""
        found = set()
        with open(path, "rb") as f:
            for i in range(self.writes):
                f.seek(self.slot(i) * self.block)
                m = MARK.match(f.read(20))
                if m and int(m.group(1)) == i:
                    found.add(i)
        return found
