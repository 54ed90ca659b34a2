"""TCP_NODELAY for a daemon that does not set it: QEMU 7.2's NBD server (fixed upstream in 8.0).

Without it, QEMU's NBD *client* (the one every VM uses) stalls on delayed ACKs: 4 KiB random I/O
measured ~350 IOPS here, 93x less than with the option. pidfd_getfd(2) duplicates the daemon's
sockets into this process; the option belongs to the socket, so setting it on the duplicate sets
the daemon's, and a listening socket passes it on to every connection it accepts.
Needs Linux >= 5.6 and ptrace rights over the daemon (the agent runs it as the same user).
"""

from __future__ import annotations

import ctypes
import os
import socket

_SYS_PIDFD_GETFD = 438  # x86_64, aarch64 and every other architecture with the unified table


def force_nodelay(pid: int) -> int:
    """Set TCP_NODELAY on every TCP socket of process ``pid``; return how many needed it.

    Raises OSError when the kernel refuses (no pidfd_getfd, no ptrace rights).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    changed = 0
    pidfd = os.pidfd_open(pid)
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not target.startswith("socket:"):
                continue
            local = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
            if local < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
            with socket.socket(fileno=local) as dup:  # closes only the duplicate
                if dup.family not in (socket.AF_INET, socket.AF_INET6) or dup.type != socket.SOCK_STREAM:
                    continue
                if not dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY):
                    dup.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    changed += 1
    finally:
        os.close(pidfd)
    return changed
