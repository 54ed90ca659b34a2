"""VBS's two version numbers: the release (``vbs --version``, the wheel's) and the wire protocol's.

The wire version numbers what crosses between the services (``vbs.wire``'s models, the agents' routes,
the heartbeats): it changes only when a release changes that, so releases of one wire version mix
freely in one install. Every call one service makes to another carries both numbers as headers
(``vbs.net.api_client.ApiClient`` adds them to every call it makes); the receiver checks them on the
request's head, before anything else is read, and refuses a wire version outside the range it serves
with ``UnsupportedWireVersion`` (400), naming both sides' versions: a call is served whole or not at
all (docs/install.md, "Upgrades").

Light on purpose: the CLI's client imports it.
"""

from __future__ import annotations

import re

from vbs import __version__ as RELEASE
from vbs.errors import VbsError

__all__ = ["RELEASE", "WIRE_VERSION", "OLDEST_WIRE", "RELEASE_HEADER", "WIRE_HEADER", "UnsupportedWireVersion",
           "sent_headers", "Peer", "peer_of_headers"]

# The wire version this release speaks, and the oldest one it still serves.
WIRE_VERSION = 1
OLDEST_WIRE = 1
# VBS 0.1.0 predates these headers: a call without either is 0.1.0's, which speaks wire version 1.
UNVERSIONED_RELEASE = "0.1.0"
UNVERSIONED_WIRE = 1

RELEASE_HEADER = "x-vbs-version"
WIRE_HEADER = "x-vbs-wire"

_WIRE_RE = re.compile(r"[0-9]{1,6}")
# PEP 440 versions as VBS writes them (0.1.0, 0.2.0rc1, 0.2.0.dev3+g1234abc), bounded.
_RELEASE_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")


class UnsupportedWireVersion(VbsError):
    """A peer speaks a wire version this service cannot serve (or sent versions it cannot read)."""

    code = "UnsupportedWireVersion"
    status = 400


def sent_headers() -> dict[str, str]:
    """The headers every call from one service to another carries."""
    return {RELEASE_HEADER: RELEASE, WIRE_HEADER: str(WIRE_VERSION)}


class Peer:
    """What a caller said of itself: its release (None when it did not say) and its wire version."""

    __slots__ = ("release", "wire")

    def __init__(self, release: str | None, wire: int) -> None:
        self.release = release
        self.wire = wire

    def __repr__(self) -> str:
        return f"Peer(release={self.release!r}, wire={self.wire})"


def peer_of_headers(release: str, wire: str, *, me: str) -> Peer:
    """The caller of a request whose headers held ``release`` and ``wire`` ("" where absent), if ``me``
    (a service's description, "storage agent storage-1") can serve it; else ``UnsupportedWireVersion``
    naming both sides' releases and wire versions."""
    if release and not _RELEASE_RE.fullmatch(release):
        raise UnsupportedWireVersion(f"{me} (VBS {RELEASE}) cannot read the caller's release in {RELEASE_HEADER}")
    said = release or (None if wire else UNVERSIONED_RELEASE)
    if wire and not _WIRE_RE.fullmatch(wire):
        raise UnsupportedWireVersion(f"{me} (VBS {RELEASE}) cannot read the caller's wire version in {WIRE_HEADER}")
    number = int(wire) if wire else UNVERSIONED_WIRE
    if not OLDEST_WIRE <= number <= WIRE_VERSION:
        raise UnsupportedWireVersion(
            f"{me} runs VBS {RELEASE}, which serves wire versions {_range()}; the caller runs VBS "
            f"{said or 'of an unknown release'} and speaks wire version {number}: refused (docs/install.md, "
            "\"Upgrades\")", peer_release=said, peer_wire=number, release=RELEASE, wire=WIRE_VERSION)
    return Peer(said, number)


def _range() -> str:
    return str(WIRE_VERSION) if OLDEST_WIRE == WIRE_VERSION else f"{OLDEST_WIRE}-{WIRE_VERSION}"
