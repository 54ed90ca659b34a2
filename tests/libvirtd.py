"""A real libvirtd (Debian's 9.0, started by hand as MACHINE-FACTS says) for the libvirt driver's tests.

libvirtd running as root keeps its state in system paths (``/run/libvirt``, ``/var/lib/libvirt``,
``/etc/libvirt``…) and cannot be moved to a temp dir, so one runs at a time on the machine (a lock
file) and only if none runs already. What it needs and is missing is made before it starts: those
directories, a ``/etc/libvirt/qemu.conf`` (QEMU's output to files instead of virtlogd, QEMU as
root, the NBD client certificate's directory in the test's dir) and the ``libvirt-qemu`` user and
group it resolves at start-up; at the end exactly what was made is removed again (an existing
qemu.conf is restored). libvirtd runs in the foreground as the test's child, its log in the test's
dir, and is stopped by its PID.
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import libvirt

from tests.conftest import stop_process, wait_until

URI = "qemu:///system"
SOCKET = Path("/run/libvirt/libvirt-sock")
STATE_DIRS = [Path("/run/libvirt"), Path("/var/lib/libvirt"), Path("/var/log/libvirt"), Path("/var/cache/libvirt")]
ETC = Path("/etc/libvirt")
QEMU_CONF = ETC / "qemu.conf"
QEMU_LOGS = Path("/var/log/libvirt/qemu")
LOCK = Path(tempfile.gettempdir()) / "vbs-tests-libvirtd.lock"
USER = "libvirt-qemu"
# Errors arrive as exceptions; libvirt's default handler would also print each one (a refused
# connection while waiting for the daemon) to stderr.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)


def _exists(kind: str, name: str) -> bool:
    try:
        (pwd.getpwnam if kind == "user" else grp.getgrnam)(name)
        return True
    except KeyError:
        return False


class Libvirtd:
    """libvirtd for one test module: ``setup`` makes what is missing and starts it, ``restart`` stops
    and starts it again (its domains keep running), ``teardown`` destroys its domains, stops it and
    removes what ``setup`` made."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log = workdir / "libvirtd.log"
        # qemu.conf's nbd_tls_x509_cert_dir: where a libvirt driver with libvirt_nbd_tls_dir puts its
        # host's client certificate for NBD over X.509.
        self.nbd_tls_dir = workdir / "nbd-tls"
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None
        self._made_dirs: list[Path] = []
        self._etc_before: set[Path] | None = None  # None: setup did not get to change /etc/libvirt
        self._etc_existed = ETC.exists()
        self._qemu_conf_before: bytes | None = None
        self._made_user = self._made_group = False

    def setup(self) -> Libvirtd:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # another worker's module runs its own one first
        if self._answers():
            raise RuntimeError(f"a libvirtd answers on {SOCKET} already: these tests start their own")
        self._made_dirs = [d for d in STATE_DIRS if not d.exists()]
        for d in self._made_dirs:
            d.mkdir(parents=True, mode=0o755)
        ETC.mkdir(exist_ok=True)
        self._etc_before = set(ETC.iterdir())
        if QEMU_CONF.exists():
            self._qemu_conf_before = QEMU_CONF.read_bytes()
        self.nbd_tls_dir.mkdir(mode=0o700, exist_ok=True)
        # namespaces = []: QEMU in the host's mount namespace. libvirt's default private namespace is
        # a copy made at VM start that sees later mounts only where "/" is a shared mount (systemd
        # makes it one; this machine's is private), and the command driver's local paths are FUSE
        # mounts made after the VM started.
        QEMU_CONF.write_text(f'stdio_handler = "file"\nuser = "root"\ngroup = "root"\nnamespaces = []\n'
                             f'nbd_tls_x509_cert_dir = "{self.nbd_tls_dir}"\n')
        if not _exists("group", USER):
            subprocess.run(["groupadd", "--system", USER], check=True)
            self._made_group = True
        if not _exists("user", USER):
            subprocess.run(["useradd", "--system", "-g", USER, "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin",
                            USER], check=True)
            self._made_user = True
        self.start()
        return self

    def _answers(self) -> bool:
        try:
            libvirt.open(URI).close()
            return True
        except libvirt.libvirtError:
            return False

    def start(self) -> None:
        log = self.log.open("ab")
        self.proc = subprocess.Popen(["libvirtd", "-p", str(self.workdir / "libvirtd.pid")],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        wait_until(lambda: self._answers() or self.proc is None or self.proc.poll() is not None, 60,
                   what="libvirtd to answer")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=30)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        time.sleep(0.5)  # its clients see the socket close
        self.start()

    def destroy_domains(self) -> None:
        conn = libvirt.open(URI)
        try:
            for dom in conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE):
                dom.destroy()
        finally:
            conn.close()

    def teardown(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.destroy_domains()
        finally:
            self.stop()
            if QEMU_LOGS.is_dir():
                shutil.copytree(QEMU_LOGS, self.workdir / "qemu-logs", dirs_exist_ok=True)
            if self._etc_before is not None:
                # libvirtd makes some of /etc/libvirt itself (secrets/, nwfilter/, qemu/…): those go too.
                for path in sorted(set(ETC.iterdir()) - self._etc_before - {QEMU_CONF}):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                if self._qemu_conf_before is not None:
                    QEMU_CONF.write_bytes(self._qemu_conf_before)
                else:
                    QEMU_CONF.unlink(missing_ok=True)
                if not self._etc_existed:
                    shutil.rmtree(ETC, ignore_errors=True)
            for d in reversed(self._made_dirs):
                shutil.rmtree(d, ignore_errors=True)
            if self._made_user:
                gid = None if self._made_group else grp.getgrnam(USER).gr_gid
                subprocess.run(["userdel", USER], check=False)
                if gid is not None and not _exists("group", USER):
                    # userdel takes the user's same-named group with it: that one was there before.
                    subprocess.run(["groupadd", "--system", "-g", str(gid), USER], check=False)
            if self._made_group and _exists("group", USER):  # userdel may have taken it already
                subprocess.run(["groupdel", USER], check=False)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
