"""What the bench scripts share: a timestamped log line on stderr, the system's name, percentiles and
the two kinds of table they print. It imports no bench script, so any of them can import it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: True if the page cache was dropped (root only)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def os_name() -> str | None:
    """The system's name as /etc/os-release gives it (PRETTY_NAME), if it does."""
    name = None
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return name


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (0-100), linear between closest ranks (p99 of 20 samples is near the max);
    NaN for no values."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (the reports that go into docs/benchmarks-history.md)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table in aligned columns, the first left-aligned and the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)), line]
    out += ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]
    return "\n".join(out)
