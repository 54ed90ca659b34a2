"""One nbdkit process per (export, host), shared by the export drivers that serve NBD over TCP: the
``nbdkit`` driver (its file plugin serves the volume) and the ``nbd`` driver (its nbd plugin is the
TCP/TLS front of qemu-storage-daemon, which then listens only on a unix socket). Each process
answers to one export name, lists none, and admits one host: its own trust anchor (anchor.py) or
its one-host PSK file. processes.py supervises them (started, adopted, stopped by PID)."""

from vbs.storage.exports.perhost.process import NBDKIT, Listener, TlsMode
from vbs.storage.exports.perhost.processes import OneHost, Processes

__all__ = ["NBDKIT", "Listener", "OneHost", "Processes", "TlsMode"]
