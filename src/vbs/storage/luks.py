"""Formatting a volume as a LUKS container (QEMU's ``luks`` format), for encrypted volumes.

The passphrase (the volume's data key, from the controller) reaches ``qemu-img`` through a 0600 file
in a private directory that is removed at once: never an argv, an environment or a log line. The
container keeps the volume's size; its header (a few MiB) comes out of what the guest sees.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pydantic import SecretStr

from vbs import argv
from vbs.files import write_private
from vbs.runtime import FALLBACK_ROOT

LUKS_MAGIC = b"LUKS\xba\xbe"
FORMAT_TIMEOUT_S = 120.0
# A memory file system (/run): the passphrase file never reaches a disk.
KEY_SCRATCH = FALLBACK_ROOT / "keys"


def format_luks(path: Path, size_bytes: int, passphrase: SecretStr, scratch: Path = KEY_SCRATCH) -> None:
    """Make ``path`` (absent) a LUKS container of ``size_bytes`` opened by ``passphrase``."""
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_dir = Path(tempfile.mkdtemp(prefix="luks-", dir=scratch))
    try:
        key_file = key_dir / "key"
        write_private(key_file, passphrase.get_secret_value())
        argv.run(["qemu-img", "create", "-q", "-f", "luks", "--object", f"secret,id=vbs-key,file={key_file}",
                  "-o", "key-secret=vbs-key", str(path), str(size_bytes)], timeout=FORMAT_TIMEOUT_S)
    finally:
        shutil.rmtree(key_dir, ignore_errors=True)
    # qemu-img made the payload that large; the container keeps the volume's size instead.
    os.truncate(path, size_bytes)


def is_luks(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(LUKS_MAGIC)) == LUKS_MAGIC
