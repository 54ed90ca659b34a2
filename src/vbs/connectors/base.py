"""The contract of a host connector, and the typed forms it turns a connection into.

A connector knows one protocol (``NbdConnection``, ``IscsiConnection``…) and answers, for each kind
of hypervisor driver, what that driver consumes to open a volume over it. Today that is QEMU's form:
the QOM objects to make first and the protocol node's ``blockdev-add`` options, and whether a node
QEMU reports is open on a given connection. Each further consumer gets its own method and result
type beside these (a libvirt disk ``<source>`` for the libvirt driver, a local device path or URL for
command profiles); the QEMU form stays as it is.

Secrets stay ``SecretStr`` inside these results (hidden from ``repr`` and logs) and are revealed
only in the QMP arguments themselves (``QemuObject.qmp_arguments``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import xml.etree.ElementTree as ET
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import SecretStr

from vbs.errors import IncorrectState, InvalidParameter
from vbs.wire.base import Wire

__all__ = ["HostConnector", "QemuIds", "QemuObject", "QemuBlockdev", "KeyFile", "bracketed", "json_filename",
           "LibvirtSource", "LibvirtAuth", "open_in_qemu"]

C = TypeVar("C", bound=Wire)

# QOM and block node ids: a letter first, then letters, digits, '-', '.', '_' (QEMU's id_wellformed).
_QEMU_ID_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class QemuIds:
    """The ids a driver gives one protocol node and the objects it may need (which of them a
    protocol uses is the connector's business; the driver deletes whichever exist)."""

    proto: str  # the protocol node
    secret: str
    tls: str

    def __post_init__(self) -> None:
        for value in (self.proto, self.secret, self.tls):
            if not _QEMU_ID_RE.fullmatch(value):
                raise InvalidParameter(f"invalid QEMU id {value!r}")
        if len(self.proto) > 31:
            raise InvalidParameter(f"QEMU node name {self.proto!r} is longer than 31 characters")

    @property
    def objects(self) -> tuple[str, ...]:
        return (self.secret, self.tls)


@dataclass(frozen=True)
class KeyFile:
    """A file QEMU reads once, when its object is made (a TLS-PSK key list)."""

    name: str
    content: SecretStr


@dataclass(frozen=True)
class QemuObject:
    """One QOM object to make (``object-add``) before the node that uses it.

    ``props`` hold nothing secret; ``secret_props`` are revealed only in the QMP arguments. With
    ``key_files``, the arguments also carry ``dir``: a fresh private directory holding those files,
    which exists only while the object is being made (``qmp_arguments``); or, with ``key_file_arg``,
    that property naming the one key file in it (a ``secret`` object's ``file``). With ``host_x509``, ``dir``
    is the host's own X.509 client credentials (``ca-cert.pem``, ``client-cert.pem``,
    ``client-key.pem``), which the hypervisor driver keeps.
    """

    qom_type: str
    id: str
    props: Mapping[str, str | int | bool] = field(default_factory=dict)
    secret_props: Mapping[str, SecretStr] = field(default_factory=dict)
    key_files: tuple[KeyFile, ...] = ()
    key_file_arg: str | None = None
    host_x509: bool = False

    def __post_init__(self) -> None:
        if self.key_file_arg is not None and len(self.key_files) != 1:
            raise InvalidParameter("key_file_arg names one key file")

    @contextmanager
    def qmp_arguments(self, secrets_dir: Path, x509_dir: Path | None = None) -> Iterator[dict[str, Any]]:
        """The ``object-add`` arguments, valid inside the ``with`` block only: key files are removed
        when it ends (QEMU has read them by then). ``x509_dir``: the host's client credentials."""
        args: dict[str, Any] = {"qom-type": self.qom_type, "id": self.id, **self.props}
        args.update((k, v.get_secret_value()) for k, v in self.secret_props.items())
        if self.host_x509:
            if x509_dir is None:
                raise InvalidParameter("this export needs the host's TLS certificate: set tls_cert, tls_key "
                                       "and tls_ca of [host_agent]")
            args["dir"] = str(x509_dir)
        if not self.key_files:
            yield args
            return
        secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(secrets_dir, 0o700)
        key_dir = Path(tempfile.mkdtemp(prefix=f"{self.id}-", dir=secrets_dir))
        written: list[Path] = []
        try:
            for key in self.key_files:
                path = key_dir / key.name
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                written.append(path)
                with os.fdopen(fd, "w") as f:
                    f.write(key.content.get_secret_value())
            if self.key_file_arg is None:
                yield {**args, "dir": str(key_dir)}
            else:
                yield {**args, self.key_file_arg: str(written[0])}
        finally:
            for path in written:
                path.unlink(missing_ok=True)
            key_dir.rmdir()


@dataclass(frozen=True)
class QemuBlockdev:
    """What QEMU needs to open a connection: ``objects`` to make first, in order, then a protocol
    node with ``options`` (``blockdev-add`` arguments without ``node-name`` and ``read-only``, which
    are the driver's)."""

    options: Mapping[str, Any]
    objects: tuple[QemuObject, ...] = ()


class HostConnector(ABC, Generic[C]):
    """Turns one protocol's connection into what hypervisor drivers consume (one module per protocol)."""

    protocol: ClassVar[str]
    # Whether an open QEMU node takes its volume's new size in place, by ``block_resize`` to that
    # size (a local file and an RBD image do; an NBD or iSCSI node keeps the size its export had
    # when it was opened, so an online resize opens a second node).
    qemu_node_sees_growth: ClassVar[bool] = False

    @abstractmethod
    def qemu_blockdev(self, connection: C, ids: QemuIds) -> QemuBlockdev:
        """The objects and protocol node QEMU opens ``connection`` with, named by ``ids``."""

    @abstractmethod
    def qemu_node_opens(self, node: Mapping[str, Any], connection: C) -> bool:
        """Whether ``node`` (an entry of ``query-named-block-nodes``) is open on ``connection``."""

    def libvirt_source(self, connection: C) -> LibvirtSource:
        """The ``<source>`` of a libvirt ``<disk type='network'>`` that opens ``connection``; a
        protocol the libvirt driver cannot open says so."""
        raise IncorrectState(f"the libvirt hypervisor driver cannot open {self.protocol} connections")


def open_in_qemu(execute: Callable[[str, dict[str, Any]], object], blockdev: QemuBlockdev, node_name: str, *,
                 read_only: bool, secrets_dir: Path, x509_dir: Path | None,
                 undo: list[Callable[[], object]]) -> None:
    """Make ``blockdev``'s objects and its protocol node ``node_name`` through ``execute`` (a QMP
    monitor's: a VM's, or a qemu-storage-daemon's), appending to ``undo`` what removes each."""
    for obj in blockdev.objects:
        with obj.qmp_arguments(secrets_dir, x509_dir) as args:
            execute("object-add", args)
        undo.append(functools.partial(execute, "object-del", {"id": obj.id}))
    execute("blockdev-add", {**blockdev.options, "node-name": node_name, "read-only": read_only, "discard": "unmap"})
    undo.append(lambda: execute("blockdev-del", {"node-name": node_name}))


def bracketed(host: str) -> str:
    """A host as it goes before ``:port`` (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


def json_filename(node: Mapping[str, Any]) -> dict[str, Any] | None:
    """The options of a node QEMU names ``json:{...}`` (it does when no URL describes them)."""
    filename = str(node.get("file", ""))
    if not filename.startswith("json:"):
        return None
    try:
        opts = json.loads(filename[5:])
    except ValueError:
        return None
    return opts if isinstance(opts, dict) else None


@dataclass(frozen=True)
class LibvirtAuth:
    """Credentials of a libvirt network disk: the user goes into ``<auth>``, the secret only into a
    libvirt secret object (``usage``: its type, ``iscsi`` or ``ceph``) that ``<auth>`` names."""

    username: str
    secret: SecretStr
    usage: str
    # How ``secret`` is written: the bytes themselves (a CHAP password), or base64 of them (a
    # cephx key, as keyrings hold it): libvirt keeps the bytes.
    encoding: str = "raw"


@dataclass(frozen=True)
class LibvirtSource:
    """What the libvirt driver puts in a ``<disk type='network'>``: the ``<source>`` attributes
    (``protocol``, ``name``), its ``<host>`` elements, the iSCSI initiator name, and the auth whose
    secret the driver keeps in a libvirt secret object. ``tls``: the source asks for TLS
    (``tls='yes'``), which libvirt takes from its own configuration, not from the disk."""

    protocol: str
    name: str
    hosts: tuple[Mapping[str, str], ...]
    initiator_iqn: str | None = None
    auth: LibvirtAuth | None = None
    tls: bool = False

    def element(self, secret_uuid: str | None = None) -> ET.Element:
        """The ``<source>`` element; ``secret_uuid`` names the secret object holding ``auth``'s secret."""
        source = ET.Element("source", {"protocol": self.protocol, "name": self.name})
        if self.tls:
            source.set("tls", "yes")
        for host in self.hosts:
            ET.SubElement(source, "host", dict(host))
        if self.initiator_iqn is not None:
            ET.SubElement(ET.SubElement(source, "initiator"), "iqn", {"name": self.initiator_iqn})
        if self.auth is not None:
            if secret_uuid is None:
                raise InvalidParameter("this source needs a libvirt secret for its credentials")
            auth = ET.SubElement(source, "auth", {"username": self.auth.username})
            ET.SubElement(auth, "secret", {"type": self.auth.usage, "uuid": secret_uuid})
        return source
