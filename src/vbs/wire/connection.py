"""Typed connection info: how a hypervisor node reaches a volume.

A storage backend makes one of these (a file backend through its export driver), the controller
forwards it (never stores it: it may hold secrets), a host connector turns it into what a
hypervisor driver consumes. Secrets are ``SecretStr``: hidden in ``repr`` and logs, revealed only
when the model is serialised to JSON for the wire (``model_dump(mode="json")``).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_serializer

from vbs.wire.base import Wire

__all__ = [
    "HostIdentity",
    "NbdConnection",
    "IscsiConnection",
    "FileConnection",
    "Connection",
    "AnyConnection",
    "ProtocolName",
    "HOST_NAME_RE",
]

HOST_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")
IQN_RE = r"^iqn\.\d{4}-\d{2}\.[a-z0-9.-]+(:[A-Za-z0-9.:_-]+)?$"
ADDRESS_RE = r"^[0-9a-fA-F.:]{2,45}$|^[a-z0-9][a-z0-9.-]{0,252}$"


ProtocolName = Literal["nbd", "iscsi", "file"]


class HostIdentity(Wire):
    """The hypervisor node an export is made for: the ACL is built from these fields."""

    name: str = Field(pattern=HOST_NAME_RE.pattern)
    address: str = Field(pattern=ADDRESS_RE)
    initiator_name: str | None = Field(default=None, pattern=IQN_RE)


class NbdConnection(Wire):
    protocol: Literal["nbd"] = "nbd"
    host: str = Field(pattern=ADDRESS_RE)
    port: int = Field(ge=1, le=65535)
    export: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:@-]+$")
    tls_psk_identity: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    tls_psk_key: SecretStr | None = None

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

    @field_serializer("chap_secret", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


class FileConnection(Wire):
    """A volume file the hypervisor opens directly: in-process only (driver tests, a local backend
    on the same machine). It is not a ``Connection``: no API accepts a raw path from the wire."""

    protocol: Literal["file"] = "file"
    path: str = Field(pattern=r"^/[^\x00]{1,4000}$")


# What may cross the wire: network protocols only, to storage nodes the controller knows.
Connection = Annotated[NbdConnection | IscsiConnection, Field(discriminator="protocol")]
# What a hypervisor driver opens, in-process.
AnyConnection = NbdConnection | IscsiConnection | FileConnection
