"""The typed placeholders a command profile may use, and the floor every rendered value stands on.

A placeholder is ``{name}`` inside an argv element of a profile. Its value comes from VBS (a VM name
the hypervisor reported, a device path a connector made, a size), never from the profile's author,
and is checked before anything runs: against the placeholder's own pattern (``fullmatch``) or its
integer bounds, and then against a floor no pattern can lower (no whitespace or control character,
no quote, no shell or option-parser metacharacter, no ``..`` path step). A profile can make the
floor higher for itself (``reject``: characters its tool splits on, such as a comma).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vbs.errors import InvalidParameter

__all__ = ["Placeholder", "LIBRARY", "check_floor", "FORBIDDEN"]

# Characters no rendered value ever holds, whatever its pattern says: whitespace and control
# characters (argv splitting in wrappers, log forging), quotes and backslashes (re-quoting by a
# tool that builds a shell line), shell metacharacters, and NUL.
FORBIDDEN = frozenset(" \t\r\n\v\f\0'\"`\\;$&|<>*?!(){}#~")


def check_floor(name: str, value: str, reject: str = "") -> str:
    """``value`` if it stands on the floor (and holds none of ``reject``), else ``InvalidParameter``."""
    bad = sorted({c for c in value if c in FORBIDDEN or c in reject or ord(c) < 0x20 or ord(c) == 0x7F})
    if bad:
        shown = ''.join(bad)
        raise InvalidParameter(f"{name}: the value {value[:80]!r} holds characters no command may get: {shown!r}")
    if any(part == ".." for part in value.split("/")):
        raise InvalidParameter(f"{name}: the value {value[:80]!r} steps out of its directory ('..')")
    if value.startswith("-"):
        raise InvalidParameter(f"{name}: the value {value[:80]!r} would read as an option")
    return value


@dataclass(frozen=True)
class Placeholder:
    """One typed placeholder: a string matching ``pattern`` in full, or an integer within bounds."""

    name: str
    description: str
    pattern: str | None = None
    minimum: int | None = None
    maximum: int | None = None

    def __post_init__(self) -> None:
        if (self.pattern is None) == (self.minimum is None or self.maximum is None):
            raise ValueError(f"placeholder {self.name}: give a pattern, or integer bounds")
        if self.pattern is not None:
            re.compile(self.pattern)

    @property
    def kind(self) -> str:
        return "string" if self.pattern is not None else "integer"

    def render(self, value: object, reject: str = "") -> str:
        """The checked text of ``value``; anything else raises ``InvalidParameter`` naming the placeholder."""
        if self.pattern is None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidParameter(f"{{{self.name}}} must be an integer, not {type(value).__name__}")
            assert self.minimum is not None and self.maximum is not None
            if not self.minimum <= value <= self.maximum:
                raise InvalidParameter(f"{{{self.name}}} must be within {self.minimum}..{self.maximum}, not {value}")
            return str(value)
        if not isinstance(value, str):
            raise InvalidParameter(f"{{{self.name}}} must be a string, not {type(value).__name__}")
        if not re.fullmatch(self.pattern, value):
            raise InvalidParameter(f"{{{self.name}}}: {value[:80]!r} does not match {self.pattern}")
        return check_floor(f"{{{self.name}}}", value, reject)


_PATH = r"/(?:[A-Za-z0-9_.+:@=-]+/)*[A-Za-z0-9_.+:@=-]+"
_HOST = r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9a-fA-F:.]{2,45}\]|[0-9.]{7,15}"
_EXPORT = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"


LIBRARY: dict[str, Placeholder] = {p.name: p for p in (
    Placeholder("vm", "the VM as the hypervisor names it (a domain name, a Xen domain, a Proxmox VMID)",
                pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
    Placeholder("serial", "the disk's serial: the volume id without its dash (vol0123…)",
                pattern=r"vol[0-9a-f]{17}"),
    Placeholder("volume", "the volume id (vol-0123…)", pattern=r"vol-[0-9a-f]{17}"),
    Placeholder("snapshot", "the snapshot id (snap-0123…)", pattern=r"snap-[0-9a-f]{17}"),
    Placeholder("source_snapshot", "the snapshot a volume is cloned from", pattern=r"snap-[0-9a-f]{17}"),
    Placeholder("target", "the guest device name VBS chose (vdb, xvdc, sdb…)", pattern=r"(?:vd|xvd|sd)[a-z]{1,2}"),
    Placeholder("index", "the disk's slot number on the VM (1 for the first VBS disk)", minimum=0, maximum=255),
    Placeholder("path", "a local path that opens the volume (made by a host connector, or a backend's file)",
                pattern=_PATH),
    Placeholder("snapshot_path", "the local path of a snapshot", pattern=_PATH),
    Placeholder("pool_path", "the backend's directory or volume group path", pattern=_PATH),
    Placeholder("access", "how the disk is opened: ro or rw", pattern=r"ro|rw"),
    Placeholder("size_bytes", "a size in bytes", minimum=0, maximum=64 << 40),
    Placeholder("size_mib", "a size in MiB (rounded up)", minimum=0, maximum=64 << 20),
    Placeholder("size_gib", "a size in GiB (rounded up; Proxmox counts in GiB)", minimum=0, maximum=64 << 10),
    Placeholder("nbd_uri", "the export as an NBD URI (nbd://host:port/export)",
                pattern=rf"nbd://(?:{_HOST}):[0-9]{{1,5}}/{_EXPORT}"),
    Placeholder("nbd_host", "the NBD server's address", pattern=_HOST),
    Placeholder("nbd_port", "the NBD server's port", minimum=1, maximum=65535),
    Placeholder("nbd_export", "the NBD export name", pattern=_EXPORT),
    Placeholder("nbd_socket", "the NBD server's unix socket (an export on this machine)", pattern=rf"{_PATH}\.sock"),
    Placeholder("format", "the image format", pattern=r"raw|qcow2"),
)}
