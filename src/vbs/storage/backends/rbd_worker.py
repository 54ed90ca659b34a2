"""The agent's side of the rbd backend's long-lived worker (``rbd_worker_main``).

Every ``rbd`` tool call costs a process start plus a cephx session with the monitors (50-170 ms on a
loaded machine); the snapshot path makes two or three of them. The worker is one child process per
backend, run by the system Python (which has python3-rados/python3-rbd; the agent's venv does not),
that keeps one rados connection open and answers the calls of the snapshot path (snapshot create,
remove, unprotect and list, the pool's long listing and its trash) as JSON lines on its stdin and
stdout. What ``rbd_cli`` says of the tools still holds: each request has the timeout the tool call
would have had, and a worker that overruns it is killed by its PID (SIGKILL) and replaced on the
next call, so a librbd call that blocks for ever never blocks the agent. Its answers are what the
tool prints with ``--format json`` (the fields the backend reads) and its failures the errno the
tool would exit with, so the callers cannot tell the two apart. The worker's argv names the conf,
the cephx user, the pool and the timeout; its environment is the minimal one; the key stays in the
keyring the conf names.

Fallbacks, all to the tool: a call the worker does not serve; a call while another thread's call
holds the worker (no queueing behind a slow call); a worker that cannot start (bindings missing:
for good, logged once; a crash: logged, tried again after ``RETRY_START_S``). A worker that cannot
connect (it says why, or does not answer within the call's timeout) fails that call, as the tool
would have with the same conf and user, instead of letting the tool wait as long again; the tool
serves the calls of the next ``RETRY_START_S``. A worker that
dies while it holds a request fails that call (``DriverError``, as a tool killed mid-call would),
except a read, which is asked again of a new worker once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from vbs.errors import DriverError
from vbs.system.processes import minimal_environment

__all__ = ["RbdWorker", "WorkerError", "request_for", "SYSTEM_PYTHON"]

log = logging.getLogger(__name__)

SYSTEM_PYTHON = Path("/usr/bin/python3")
WORKER_SCRIPT = Path(__file__).with_name("rbd_worker_main.py")
EXIT_NO_BINDINGS = 3
RETRY_START_S = 30.0
_READS = {"snap_list", "list_long", "trash_list"}
_MAX_LINE = 64 << 20


class WorkerError(DriverError):
    """The worker answered with a failure: ``errno`` as the tool would have exited with."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


class _Unavailable(Exception):
    """The worker cannot take this call: the caller runs the tool instead."""


def _image_spec(spec: str, pool: str, *, snapshot: bool) -> dict[str, str] | None:
    """``pool/image@snap`` (or ``pool/image``) of this pool as request fields, or None."""
    head, sep, rest = spec.partition("/")
    if head != pool or not sep:
        return None
    image, at, snap = rest.partition("@")
    if not image or "/" in image or (bool(at) != snapshot) or (snapshot and not snap):
        return None
    return {"image": image, "snap": snap} if snapshot else {"image": image}


def request_for(args: tuple[str, ...], pool: str) -> dict[str, Any] | None:
    """The worker's request for the ``rbd`` tool call ``args`` against ``pool``, or None when the
    worker does not serve it (the tool does)."""
    match args:
        case ("snap", "create" | "rm" | "unprotect" as verb, spec):
            fields = _image_spec(spec, pool, snapshot=True)
            op = {"create": "snap_create", "rm": "snap_remove", "unprotect": "snap_unprotect"}[verb]
            return None if fields is None else {"op": op, **fields}
        case ("snap", "ls", "--all", "--format", "json", spec):
            fields = _image_spec(spec, pool, snapshot=False)
            return None if fields is None else {"op": "snap_list", **fields}
        case ("snap", "ls", "--all", "--format", "json", "--pool", p, "--image-id", image_id) if p == pool:
            return {"op": "snap_list", "image_id": image_id}
        case ("ls", "-l", "--format", "json", p) if p == pool:
            return {"op": "list_long"}
        case ("trash", "ls", "--all", "--format", "json", p) if p == pool:
            return {"op": "trash_list"}
    return None


class RbdWorker:
    """One worker process for a pool, started on first use, replaced after it dies or is killed."""

    def __init__(self, name: str, ceph_conf: Path, ceph_user: str, rbd_pool: str, timeout_s: float,
                 python: Path = SYSTEM_PYTHON) -> None:
        self.name, self.ceph_conf, self.ceph_user, self.rbd_pool = name, ceph_conf, ceph_user, rbd_pool
        self.timeout_s, self.python = timeout_s, python
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self.disabled = False  # the bindings are missing: the tool for good
        self._next_start = 0.0
        self.started = 0  # workers started so far (a replaced one counts again)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None or proc.poll() is not None else proc.pid

    def call(self, args: tuple[str, ...]) -> str | None:
        """The tool's stdout for ``args`` as the worker answers it, or None: the caller runs the tool."""
        if self.disabled:
            return None
        request = request_for(args, self.rbd_pool)
        if request is None or not self._lock.acquire(blocking=False):
            return None
        try:
            return self._call(args, request)
        except _Unavailable:
            return None
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._kill()

    # -- under the lock -----------------------------------------------------------------------------

    def _call(self, args: tuple[str, ...], request: dict[str, Any]) -> str:
        what = f"pool {self.name}: rbd {args[0]}"
        for attempt in (1, 2):
            sent = False
            try:
                proc = self._running()
                assert proc.stdin is not None
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
                sent = True
                answer = self._answer(time.monotonic() + self.timeout_s + 5)
            except TimeoutError:
                self._kill()
                raise DriverError(f"{what} did not answer within {self.timeout_s:g}s") from None
            except (BrokenPipeError, EOFError, OSError, ValueError) as exc:
                self._kill()  # it died (killed, crashed): a request it never read is sent again
                if attempt == 1 and (not sent or request["op"] in _READS):
                    continue
                raise DriverError(f"{what} failed: the rbd worker ended ({type(exc).__name__})") from None
            if "errno" in answer:
                errno = answer["errno"] if isinstance(answer["errno"], int) else 22
                raise WorkerError(f"{what} failed: {str(answer.get('error', ''))[:500]}", errno)
            return json.dumps(answer.get("out"))
        raise AssertionError("unreachable")

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()
        if time.monotonic() < self._next_start:
            raise _Unavailable()
        return self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        argv = [str(self.python), "-I", str(WORKER_SCRIPT), str(self.ceph_conf), self.ceph_user, self.rbd_pool,
                str(int(self.timeout_s))]
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # noqa: S603
                                          stderr=subprocess.DEVNULL, env=minimal_environment(), close_fds=True)
        except OSError as exc:
            self.disabled = True
            log.warning("pool %s: the rbd worker cannot start (%s); the rbd tool serves every call", self.name, exc)
            raise _Unavailable() from None
        self._buf = b""
        self.started += 1
        try:
            ready = self._answer(time.monotonic() + self.timeout_s + 5)
        except TimeoutError:
            # No connection within the call's whole timeout: the call fails as the tool's would have,
            # rather than wait as long again for the tool; the tool serves calls for RETRY_START_S.
            self._kill()
            self._next_start = time.monotonic() + RETRY_START_S
            raise DriverError(f"pool {self.name}: the rbd worker did not connect within {self.timeout_s:g}s") \
                from None
        except (EOFError, OSError, ValueError):
            ready = {}
        if ready.get("ready") is True:
            log.info("pool %s: rbd worker %d started", self.name, self._proc.pid)
            return self._proc
        proc = self._proc
        self._kill()
        if proc.returncode == EXIT_NO_BINDINGS:
            self.disabled = True
            log.warning("pool %s: %s has no python3-rados/python3-rbd; the rbd tool serves every call",
                        self.name, self.python)
            raise _Unavailable()
        self._next_start = time.monotonic() + RETRY_START_S
        reason = str(ready.get("error", f"exit {proc.returncode}"))[:200]
        log.warning("pool %s: the rbd worker did not start (%s); the rbd tool serves calls for %gs",
                    self.name, reason, RETRY_START_S)
        if "error" in ready:
            # It could not connect, and said why: the tool, with the same conf and user, would not
            # either; this call fails rather than wait for the tool as long again.
            raise DriverError(f"pool {self.name}: the rbd worker could not connect: {reason}")
        raise _Unavailable()

    def _answer(self, deadline: float) -> dict[str, Any]:
        """The next line on the worker's stdout, as JSON; TimeoutError past ``deadline``, EOFError if it ended."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError()
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                raise ValueError("answer too long")
        line, _, self._buf = self._buf.partition(b"\n")
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise ValueError("not an object")
        return answer

    def _kill(self) -> None:
        """Kill the worker by its PID (SIGKILL: a stopped or blocked one too) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
