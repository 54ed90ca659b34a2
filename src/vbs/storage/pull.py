"""Pulling a volume from another storage node's NBD export into a file here: how an available
volume moves between nodes whose pools are their own (files).

The source node exports the volume to this node as it would to a host (its ACL names this node, its
TLS is the host's: this node's X.509 certificate as a client, or the PSK the connection carries), and
``qemu-img convert`` copies it, skipping zeros (the target is a fresh sparse file), with progress.
The connection's key file exists only while the copy runs, in a private directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from contextlib import ExitStack
from pathlib import Path

from vbs.connectors.base import QemuIds
from vbs.connectors.nbd import NbdConnector
from vbs.errors import DriverError
from vbs.storage.copy import CopyCancelled, ProgressCallback
from vbs.wire.connection import NbdConnection

__all__ = ["pull_argv", "pull"]

_PERCENT_RE = re.compile(rb"\((\d+(?:\.\d+)?)/100%\)")
_IDS = QemuIds("vbs-pull", "vbs-pull-sec", "vbs-pull-tls")


def pull_argv(source: NbdConnection, target: Path, objects: list[dict[str, object]]) -> list[str]:
    """``qemu-img convert`` of the export into ``target`` (which exists, zeroed, of the same size)."""
    blockdev = NbdConnector().qemu_blockdev(source, _IDS)
    image = {"driver": "raw", "file": dict(blockdev.options)}
    argv = ["qemu-img", "convert", "-p", "-n", "--target-is-zero", "-O", "raw"]
    for obj in objects:
        argv += ["--object", json.dumps(obj)]
    return [*argv, "json:" + json.dumps(image), str(target)]


def pull(source: NbdConnection, target: Path, size_bytes: int, *, secrets_dir: Path, x509_dir: Path | None,
         cancel: threading.Event, progress: ProgressCallback) -> None:
    """Copy the volume ``source`` serves into ``target``; ``CopyCancelled`` once ``cancel`` is set."""
    blockdev = NbdConnector().qemu_blockdev(source, _IDS)
    with ExitStack() as stack:
        objects = [stack.enter_context(obj.qmp_arguments(secrets_dir, x509_dir)) for obj in blockdev.objects]
        proc = subprocess.Popen(pull_argv(source, target, objects),  # noqa: S603 - argv list, no shell
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        watcher = threading.Thread(target=_stop_on_cancel, args=(proc, cancel), daemon=True)
        watcher.start()
        assert proc.stdout is not None and proc.stderr is not None
        buffer = b""
        while chunk := os.read(proc.stdout.fileno(), 4096):
            buffer = (buffer + chunk)[-256:]
            found = _PERCENT_RE.findall(buffer)
            if found:
                progress(int(float(found[-1]) * size_bytes / 100), size_bytes)
        errors = proc.stderr.read().decode(errors="replace")
        code = proc.wait()
        # Not joined: the watcher sees the end within its 0.2 s tick and returns; waiting for it would add
        # up to that much to every pull.
    if cancel.is_set():
        raise CopyCancelled()
    if code != 0:
        raise DriverError(f"qemu-img exited with {code}: {errors.strip()[-500:]}")
    progress(size_bytes, size_bytes)


def _stop_on_cancel(proc: subprocess.Popen[bytes], cancel: threading.Event) -> None:
    while not cancel.wait(0.2):
        if proc.poll() is not None:
            return  # it ended by itself
    if proc.poll() is None:
        proc.terminate()  # the process this module started, by its own handle
