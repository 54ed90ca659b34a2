"""Running external tools: argv lists only, always with a timeout.

Nothing here accepts a shell string. A non-zero exit or a timeout becomes a ``DriverError`` that
names the tool and carries the tail of its stderr.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence

from vbs.errors import DriverError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0


def run(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    check: bool = True,
    env: dict[str, str] | None = None,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a list, never a shell string) and return the finished process."""
    if isinstance(argv, str):
        raise TypeError("argv must be a sequence of arguments, not a string")
    args = [str(a) for a in argv]
    log.debug("run %s", args[0])
    try:
        proc = subprocess.run(  # noqa: S603 - argv list, no shell
            args,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            input=input_text,
            check=False,
        )
    except FileNotFoundError as exc:
        raise DriverError(f"{args[0]}: not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise DriverError(f"{args[0]}: no answer within {timeout:g}s") from exc
    if check and proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-500:]
        raise DriverError(f"{args[0]} exited with {proc.returncode}: {tail}")
    return proc
