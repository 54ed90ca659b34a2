"""Typed connection info: how a hypervisor node reaches a volume.

A storage backend makes one of these (a file backend through its export driver), the controller
forwards it (never stores it: it may hold secrets), a host connector turns it into what a
hypervisor driver consumes. Secrets are ``SecretStr``: hidden in ``repr`` and logs, revealed only
when the model is serialised to JSON for the wire (``model_dump(mode="json")``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, SecretStr, field_serializer, field_validator, model_validator

from vbs.wire.base import VolumeId, Wire

__all__ = [
    "HostIdentity",
    "NbdConnection",
    "IscsiConnection",
    "FileConnection",
    "RbdConnection",
    "LocalConnection",
    "Connection",
    "HostConnection",
    "AnyConnection",
    "ProtocolName",
    "HOST_NAME_RE",
    "NBD_SOCKET_RE",
    "MONITOR_RE",
    "MAX_MONITORS",
    "POOL_NAME_RE",
]

POOL_NAME_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
HOST_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")
IQN_RE = r"^iqn\.\d{4}-\d{2}\.[a-z0-9.-]+(:[A-Za-z0-9.:_-]+)?$"
ADDRESS_RE = r"^[0-9a-fA-F.:]{2,45}$|^[a-z0-9][a-z0-9.-]{0,252}$"
# A unix socket of an NBD server on the host's own machine: absolute, plain components (no "." or
# "..", no empty one), ending in ".sock", within sun_path's 107 bytes. Nothing else is a socket a
# host agent lets its hypervisor open on a controller's word.
NBD_SOCKET_RE = re.compile(r"(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,254})+\.sock")
NBD_SOCKET_MAX = 107
# A Ceph monitor as a host opens it: an IPv4 address, a bracketed IPv6 address or a DNS name, and
# a port. A monitor map holds a handful; more is not a cluster a host should be sent to.
MONITOR_RE = re.compile(r"(?:[0-9]{1,3}(?:\.[0-9]{1,3}){3}|\[[0-9a-fA-F:.]{2,45}\]|[a-z0-9][a-z0-9.-]{0,252}):"
                        r"(?:[1-9][0-9]{0,4})")
MAX_MONITORS = 16
_CEPH_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
# A cephx key as Ceph prints it: base64 of a 28-byte secret (longer ones are refused too).
_CEPHX_KEY_RE = re.compile(r"[A-Za-z0-9+/]{16,128}={0,2}")


ProtocolName = Literal["nbd", "iscsi", "file", "rbd"]


class HostIdentity(Wire):
    """The hypervisor node an export is made for: the ACL is built from these fields."""

    name: str = Field(pattern=HOST_NAME_RE.pattern)
    address: str = Field(pattern=ADDRESS_RE)
    initiator_name: str | None = Field(default=None, pattern=IQN_RE)


class NbdConnection(Wire):
    """An NBD export, over TCP (``host`` and ``port``) or a unix socket on the host's own machine
    (``socket``). ``tls``: ``x509`` (the host presents its certificate from the install's CA and
    checks the server's), ``psk`` (the per-host identity and key given here), or none (a unix
    socket, or a TCP export its operator runs ``--insecure``)."""

    protocol: Literal["nbd"] = "nbd"
    host: str | None = Field(default=None, pattern=ADDRESS_RE)
    port: int | None = Field(default=None, ge=1, le=65535)
    socket: str | None = Field(default=None, max_length=NBD_SOCKET_MAX)
    export: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:@-]+$")
    tls: Literal["x509", "psk"] | None = None
    tls_psk_identity: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    tls_psk_key: SecretStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _psk_without_mode(cls, data: Any) -> Any:
        # Connections of agents older than the x509 mode name only the PSK.
        if isinstance(data, dict) and data.get("tls") is None and data.get("tls_psk_key") is not None:
            return {**data, "tls": "psk"}
        return data

    @model_validator(mode="after")
    def _one_transport(self) -> NbdConnection:
        if self.socket is not None:
            if self.host is not None or self.port is not None:
                raise ValueError("an NBD connection is either a unix socket or host and port, not both")
            if not NBD_SOCKET_RE.fullmatch(self.socket) or "/../" in self.socket + "/" or "/./" in self.socket:
                raise ValueError("NBD socket must be an absolute path of plain components ending in .sock")
        elif self.host is None or self.port is None:
            raise ValueError("an NBD connection needs a unix socket, or host and port")
        if self.tls == "psk" and (self.tls_psk_key is None or self.tls_psk_identity is None):
            raise ValueError("TLS-PSK needs an identity and a key")
        return self

    @field_serializer("tls_psk_key", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


class IscsiConnection(Wire):
    protocol: Literal["iscsi"] = "iscsi"
    host: str = Field(pattern=ADDRESS_RE)
    port: int = Field(ge=1, le=65535)
    iqn: str = Field(pattern=IQN_RE)
    lun: int = Field(default=1, ge=0, le=255)
    chap_user: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    chap_secret: SecretStr | None = None
    initiator_name: str | None = Field(default=None, pattern=IQN_RE)
    # "stunnel": the portal speaks TLS (iSCSI has none of its own); the host tunnels to it with
    # its certificate from the install's CA.
    tls: Literal["stunnel"] | None = None

    @field_serializer("chap_secret", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


class RbdConnection(Wire):
    """A Ceph RBD image the hypervisor opens itself (librbd), as the cephx ``user`` whose ``key``
    this connection carries: a user made for this one attachment, whose caps reach that image only
    (read-only ones for a read-only attachment). ``monitors``: where the host finds the cluster;
    the controller forwards only monitors the storage node reported for its pools."""

    # A refused key is not repeated in the error's text (which may reach a log).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    protocol: Literal["rbd"] = "rbd"
    monitors: list[str] = Field(min_length=1, max_length=MAX_MONITORS)
    pool: str = Field(pattern=_CEPH_NAME_RE)
    namespace: str | None = Field(default=None, pattern=_CEPH_NAME_RE)
    image: VolumeId
    user: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    key: SecretStr
    read_only: bool = False

    @field_validator("monitors")
    @classmethod
    def _monitors(cls, monitors: list[str]) -> list[str]:
        for monitor in monitors:
            if not MONITOR_RE.fullmatch(monitor) or not 1 <= int(monitor.rpartition(":")[2]) <= 65535:
                raise ValueError(f"a monitor is address:port, not {monitor[:64]!r}")
        if len(set(monitors)) != len(monitors):
            raise ValueError("a monitor is named twice")
        return monitors

    @field_validator("key")
    @classmethod
    def _key(cls, key: SecretStr) -> SecretStr:
        if not _CEPHX_KEY_RE.fullmatch(key.get_secret_value()):
            raise ValueError("a cephx key is base64")  # the value itself is never repeated
        return key

    @field_serializer("key", when_used="json")
    def _reveal(self, v: SecretStr) -> str:
        return v.get_secret_value()


class FileConnection(Wire):
    """A volume file the hypervisor opens directly: in-process only (driver tests, a local backend
    on the same machine). It is not a ``Connection``: no API accepts a raw path from the wire."""

    protocol: Literal["file"] = "file"
    path: str = Field(pattern=r"^/[^\x00]{1,4000}$")


class LocalConnection(Wire):
    """A volume of one of the host's own local pools (semi-shared storage), named by pool and volume
    id: the host agent resolves it to its own file, so no raw path crosses the wire, and it opens on
    that host only (there is no network hop)."""

    protocol: Literal["local"] = "local"
    pool: str = Field(pattern=POOL_NAME_RE)
    volume_id: VolumeId


# What may cross the wire: network protocols only, to storage nodes the controller knows.
Connection = Annotated[NbdConnection | IscsiConnection | RbdConnection, Field(discriminator="protocol")]
# What a host agent is asked to attach: those, or a volume of its own local pool.
HostConnection = Annotated[NbdConnection | IscsiConnection | RbdConnection | LocalConnection,
                           Field(discriminator="protocol")]
# What a hypervisor driver opens, in-process.
AnyConnection = NbdConnection | IscsiConnection | RbdConnection | FileConnection
