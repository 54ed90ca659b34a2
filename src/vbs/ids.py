"""Resource ids in EBS form: a prefix and 17 lowercase hex digits (``vol-0123456789abcdef0``)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

from vbs.errors import InvalidParameter

PREFIXES = {
    "volume": "vol",
    "snapshot": "snap",
    "attachment": "att",
    "instance": "i",
    "operation": "op",
    "modification": "mod",
    "volume-key": "vk",
    "lifecycle-policy": "policy",
    "policy-run": "run",
}

_HEX = 17


def new_id(kind: str) -> str:
    """A fresh random id; uniqueness is enforced by the database (a collision retries)."""
    return f"{PREFIXES[kind]}-{secrets.token_hex(9)[:_HEX]}"


def id_pattern(kind: str) -> re.Pattern[str]:
    return re.compile(rf"^{PREFIXES[kind]}-[0-9a-f]{{{_HEX}}}$")


_PATTERNS = {kind: id_pattern(kind) for kind in PREFIXES}


def is_valid(kind: str, value: object) -> bool:
    return isinstance(value, str) and bool(_PATTERNS[kind].fullmatch(value))


def check(kind: str, value: object) -> str:
    """Return ``value`` if it is a well-formed id of ``kind``, else raise ``InvalidParameter``."""
    if not is_valid(kind, value):
        shown = repr(value)[:80]
        raise InvalidParameter(f'Invalid id: {shown} (expecting "{PREFIXES[kind]}-" and 17 hex digits)')
    return value  # type: ignore[return-value]


def must_be(kind: str) -> Callable[[str], str]:
    """A pydantic validator for ids of ``kind`` (it raises ``ValueError``, which pydantic reports)."""

    def check_id(value: str) -> str:
        if not is_valid(kind, value):
            raise ValueError(f'invalid id {value[:40]!r} (expecting "{PREFIXES[kind]}-" and {_HEX} hex digits)')
        return value

    return check_id


def virtio_serial(volume_id: str) -> str:
    """The virtio-blk serial of a volume: its id without the dash, exactly 20 bytes."""
    check("volume", volume_id)
    return volume_id.replace("-", "", 1)


def volume_of_serial(serial: str) -> str | None:
    """The volume whose virtio serial ``serial`` is, or None for a serial that is not one of ours."""
    prefix = PREFIXES["volume"]
    volume_id = f"{prefix}-{serial[len(prefix):]}" if serial.startswith(prefix) else ""
    return volume_id if is_valid("volume", volume_id) else None
