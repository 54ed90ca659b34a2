"""Encrypted volumes as LUKS containers (QEMU's ``luks`` format): formatting, re-encrypting, sizing.

The passphrases (data keys, from the controller) reach ``qemu-img`` through 0600 files in a private
directory on a memory file system that is removed at once: never an argv, an environment or a log line.
A container holds the volume's size as its payload — the guest sees exactly the size it asked for —
plus the LUKS header in front (``header_bytes``), which the pool's file is that much longer for.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import SecretStr

from vbs.errors import DriverError
from vbs.qemu import luks1
from vbs.system import argv
from vbs.system.files import write_private
from vbs.system.socket_paths import FALLBACK_ROOT

log = logging.getLogger(__name__)

LUKS_MAGIC = luks1.LUKS_MAGIC
FORMAT_TIMEOUT_S = 120.0
CONVERT_TIMEOUT_S = 6 * 3600.0
# Before it writes a LUKS header, QEMU times 2^15 PBKDF2 iterations on the thread's CPU clock to choose
# the key slot's count. Where that clock advances in ticks (a VM's kernel), the run can read 0 ms and
# qemu-img gives up: "Unable to get accurate CPU usage" (8 tries in 20 on the test machines). No header
# was written then (the file it made is removed), and another try costs milliseconds.
_CALIBRATION_FAILED = "Unable to get accurate CPU usage"
CALIBRATION_TRIES = 20
# A memory file system (/run): the passphrase files never reach a disk.
KEY_SCRATCH = FALLBACK_ROOT / "keys"


@contextmanager
def _key_files(*passphrases: SecretStr, scratch: Path = KEY_SCRATCH) -> Iterator[list[Path]]:
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_dir = Path(tempfile.mkdtemp(prefix="luks-", dir=scratch))
    try:
        files = []
        for n, passphrase in enumerate(passphrases):
            files.append(key_dir / f"key{n}")
            write_private(files[-1], passphrase.get_secret_value())
        yield files
    finally:
        shutil.rmtree(key_dir, ignore_errors=True)


def run_luks_writer(args: list[str], target: Path, timeout: float) -> None:
    """Run ``qemu-img`` that writes a new LUKS container at ``target``, again while its calibration of the
    key derivation fails (see ``_CALIBRATION_FAILED``); any other failure is the caller's."""
    for attempt in range(1, CALIBRATION_TRIES + 1):
        try:
            argv.run(args, timeout=timeout)
            return
        except DriverError as exc:
            if _CALIBRATION_FAILED not in exc.message or attempt == CALIBRATION_TRIES:
                raise
            target.unlink(missing_ok=True)
            log.info("qemu-img could not time the key derivation (try %d of %d): trying again", attempt,
                     CALIBRATION_TRIES)


def format_luks(path: Path, size_bytes: int, passphrase: SecretStr) -> None:
    """Make ``path`` (absent) an empty LUKS container whose payload is ``size_bytes``."""
    with _key_files(passphrase) as (key,):
        run_luks_writer(["qemu-img", "create", "-q", "-f", "luks", "--object", f"secret,id=vbs-key,file={key}",
                       "-o", "key-secret=vbs-key", str(path), str(size_bytes)], path, FORMAT_TIMEOUT_S)


def convert_to_luks(source: Path, target: Path, size_bytes: int, passphrase: SecretStr,
                    source_passphrase: SecretStr | None) -> None:
    """Write into ``target`` (absent) a LUKS container under ``passphrase`` holding what ``source`` holds (a
    LUKS container under ``source_passphrase``, or plain data), its payload grown to ``size_bytes``. The
    plaintext exists only inside this ``qemu-img`` process."""
    keys = (passphrase,) if source_passphrase is None else (passphrase, source_passphrase)
    with _key_files(*keys) as files:
        objects = ["--object", f"secret,id=vbs-dst,file={files[0]}"]
        if source_passphrase is None:
            src = ["-f", "raw", str(source)]
        else:
            objects += ["--object", f"secret,id=vbs-src,file={files[1]}"]
            src = ["--image-opts", f"driver=luks,key-secret=vbs-src,file.driver=file,file.filename={source}"]
        run_luks_writer(["qemu-img", "convert", "-q", *objects, *src, "-O", "luks", "-o", "key-secret=vbs-dst",
                       str(target)], target, CONVERT_TIMEOUT_S)
    header = header_bytes(target)
    if size_bytes > os.stat(target).st_size - header:
        os.truncate(target, size_bytes + header)


def header_bytes(path: Path) -> int:
    """How far into ``path`` (a container VBS made: LUKS1, as QEMU writes them) its payload starts. Asked
    only of what the controller says is a container: a guest may write a LUKS header on a plain volume."""
    with open(path, "rb") as f:
        head = f.read(luks1.HEADER_BYTES)
    try:
        return luks1.parse_header(head).payload_offset
    except luks1.NotLuks as exc:
        raise DriverError(f"{path.name} is {exc.message}") from None
