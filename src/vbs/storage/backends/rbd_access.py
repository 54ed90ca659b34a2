"""Who may open which RBD image: the cephx user of one attachment and the caps it gets.

A host that opens a volume's image natively (QEMU's librbd) does so as a cephx user made for that
one (host, volume) pair, ``client.vbs.<host>.<volume>``, with ``mon 'profile rbd'`` and OSD caps
that name the image's own RADOS objects by ``object_prefix`` (measured with Ceph 16's librbd,
``tests/test_rbd_native.py`` proves it with QEMU):

- ``rbd_id.<name>`` (name to id), ``rbd_header.<id>`` (header, watch, exclusive lock, resize,
  snapshots), ``rbd_object_map.<id>`` (object map and its snapshots' maps), ``rbd_data.<id>.``
  (the data; the trailing dot keeps an image whose id merely starts with this one out): ``rwx``,
  or ``rx`` for a read-only attachment — except the header, ``rwx`` always: QEMU opens an rbd
  image read-write also for a read-only node (so that it can be reopened read-write), and librbd's
  read-write open watches the header, which is a write. Such a user reads the data and cannot
  change a byte of it (a shrink, which trims data objects first, fails too), but could change the
  header's metadata (grow the image);
- ``rbd_info`` (``rx``): librbd reads the pool's metadata when it opens an image, and fails
  without it;
- a clone's parents, each by id: header, object map and data, ``rx`` only; opening a parent by id
  looks its name up in ``rbd_directory`` (or ``rbd_trash`` once it was deleted), so a clone's user
  may also read those two (names and ids of the pool's images, no data).

Nothing else of the pool is reachable: not another image's header or data, not the pool listing.
(``rbd info`` of the image fails: it reads mirroring state, which QEMU never asks for.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from vbs import ids
from vbs.config import RBD_POOL_RE
from vbs.errors import DriverError, InvalidParameter
from vbs.pools.exports import RBD_IMAGE_RE
from vbs.wire.connection import HOST_NAME_RE, MAX_MONITORS, MONITOR_RE
from vbs.wire.storage import ExportInfo

__all__ = ["ImageRef", "attachment_user", "osd_caps", "MON_CAPS", "parse_image_ref", "parse_monitors",
           "parse_key", "parse_caps", "parse_attachment_users", "parse_mon_names", "parse_sessions", "MAX_CLONE_CHAIN"]

MON_CAPS = "profile rbd"
# Deeper chains than this are not followed (the backend keeps clone chains far shorter).
MAX_CLONE_CHAIN = 64
_IMAGE_ID_RE = re.compile(r"[0-9a-f]{4,64}")
_CEPH_NAME_RE = re.compile(RBD_POOL_RE.strip("^$"))  # pools, namespaces, monitors: Ceph's names
_USER_PREFIX = "vbs."
_CLIENT_ADDR_RE = re.compile(r"(?:[0-9]{1,3}(?:\.[0-9]{1,3}){3}|\[[0-9a-fA-F:.]{2,45}\]):[0-9]{1,5}/[0-9]{1,10}")


@dataclass(frozen=True)
class ImageRef:
    """An RBD image as ``rbd info`` names it: where it is, its id, and its parent's place and id."""

    pool: str
    namespace: str
    id: str
    parent: tuple[str, str, str] | None = None  # (pool, namespace, id)

    def __post_init__(self) -> None:
        for pool, namespace, image_id in (self.spec, *([self.parent] if self.parent else [])):
            if not _CEPH_NAME_RE.fullmatch(pool) or (namespace and not _CEPH_NAME_RE.fullmatch(namespace)):
                raise DriverError(f"rbd info: unexpected pool or namespace {pool[:64]!r}/{namespace[:64]!r}")
            if not _IMAGE_ID_RE.fullmatch(image_id):
                raise DriverError(f"rbd info: unexpected image id {image_id[:70]!r}")

    @property
    def spec(self) -> tuple[str, str, str]:
        return self.pool, self.namespace, self.id


def attachment_user(host_name: str, volume_id: str) -> str:
    """The cephx user id (after ``client.``) of ``host_name``'s attachment of ``volume_id``."""
    ids.check("volume", volume_id)
    if not isinstance(host_name, str) or not HOST_NAME_RE.fullmatch(host_name):
        raise InvalidParameter(f"invalid host name {str(host_name)[:64]!r}")
    return f"{_USER_PREFIX}{host_name}.{volume_id}"


def _grant(perm: str, pool: str, namespace: str, prefix: str) -> str:
    where = f"pool={pool}" + (f" namespace={namespace}" if namespace else "")
    return f"allow {perm} {where} object_prefix {prefix}"


def osd_caps(name: str, chain: list[ImageRef], *, read_only: bool) -> str:
    """The OSD caps of a user that opens the image ``name`` (``chain[0]``, then its parents)."""
    if not chain or not re.fullmatch(RBD_IMAGE_RE, name):
        raise InvalidParameter(f"invalid RBD image {name[:130]!r}")
    image = chain[0]
    perm = "rx" if read_only else "rwx"
    grants = [_grant(perm, image.pool, image.namespace, f"rbd_id.{name}"),
              # QEMU opens every rbd image read-write (librbd then watches the header, a write).
              _grant("rwx", image.pool, image.namespace, f"rbd_header.{image.id}"),
              _grant(perm, image.pool, image.namespace, f"rbd_object_map.{image.id}"),
              _grant(perm, image.pool, image.namespace, f"rbd_data.{image.id}.")]
    places = {(image.pool, image.namespace)}
    for parent in chain[1:]:
        grants += [_grant("rx", parent.pool, parent.namespace, f"{kind}.{parent.id}")
                   for kind in ("rbd_header", "rbd_object_map")]
        grants.append(_grant("rx", parent.pool, parent.namespace, f"rbd_data.{parent.id}."))
        places.add((parent.pool, parent.namespace))
    for pool, namespace in sorted(places):
        grants.append(_grant("rx", pool, namespace, "rbd_info"))
        if len(chain) > 1:
            grants += [_grant("rx", pool, namespace, obj) for obj in ("rbd_directory", "rbd_trash")]
    return ", ".join(grants)


def parse_image_ref(text: str, pool: str, namespace: str = "") -> ImageRef:
    """``rbd info --format json`` of an image (by name or by id) in ``pool``/``namespace``."""
    info = _json(text, "rbd info")
    image_id, parent = info.get("id"), info.get("parent")
    if not isinstance(image_id, str):
        raise DriverError("rbd info: no image id (a format 1 image?)")
    ref_parent = None
    if isinstance(parent, dict):
        p_pool, p_ns, p_id = parent.get("pool"), parent.get("pool_namespace") or "", parent.get("id")
        if not (isinstance(p_pool, str) and isinstance(p_ns, str) and isinstance(p_id, str)):
            raise DriverError("rbd info: a parent without pool or id")
        ref_parent = (p_pool, p_ns, p_id)
    return ImageRef(pool=pool, namespace=namespace, id=image_id, parent=ref_parent)


def parse_monitors(text: str) -> list[str]:
    """``ceph mon dump --format json``: each monitor's msgr2 address (its v1 one if it has none)."""
    dump = _json(text, "ceph mon dump")
    found: list[str] = []
    for mon in dump.get("mons", []):
        addrs = mon.get("public_addrs", {}).get("addrvec", []) if isinstance(mon, dict) else []
        by_type = {a.get("type"): a.get("addr") for a in addrs if isinstance(a, dict)}
        addr = by_type.get("v2") or by_type.get("v1")
        if isinstance(addr, str) and MONITOR_RE.fullmatch(addr) and addr not in found:
            found.append(addr)
    if not found or len(found) > MAX_MONITORS:
        raise DriverError(f"ceph mon dump: {len(found)} usable monitor addresses")
    return found


def parse_attachment_users(text: str, pool: str) -> list[ExportInfo]:
    """``ceph auth ls --format json``: the attachment users whose image is in ``pool``, one entry each."""
    dump = _loads(text, "ceph auth ls")
    found: list[ExportInfo] = []
    for entry in dump.get("auth_dump", []) if isinstance(dump, dict) else []:
        entity = entry.get("entity") if isinstance(entry, dict) else None
        if not isinstance(entity, str) or not entity.startswith(f"client.{_USER_PREFIX}"):
            continue
        host, _, volume = entity.removeprefix(f"client.{_USER_PREFIX}").rpartition(".")
        osd = entry.get("caps", {}).get("osd", "")
        if (HOST_NAME_RE.fullmatch(host) and ids.is_valid("volume", volume) and isinstance(osd, str)
                and f"pool={pool} object_prefix rbd_id.{volume}," in osd):
            found.append(ExportInfo(key=volume, host=host, protocol="rbd", target=entity))
    return found


def parse_mon_names(text: str) -> list[str]:
    """``ceph mon dump --format json``: the monitors' names (``ceph tell mon.<name>``)."""
    names = [m.get("name") for m in _json(text, "ceph mon dump").get("mons", []) if isinstance(m, dict)]
    return [n for n in names if isinstance(n, str) and _CEPH_NAME_RE.fullmatch(n)]


def parse_sessions(text: str, entity: str) -> list[str]:
    """``ceph tell mon.X sessions --format json``: the client addresses (``addr/nonce``, what
    ``ceph osd blocklist add`` takes) of ``entity``'s sessions on that monitor."""
    sessions = _loads(text, "ceph tell mon sessions")
    found: list[str] = []
    for session in sessions if isinstance(sessions, list) else []:
        if not isinstance(session, dict) or session.get("entity_name") != entity:
            continue
        for addr in session.get("addrs", {}).get("addrvec", []):
            client = f"{addr.get('addr')}/{addr.get('nonce')}" if isinstance(addr, dict) else ""
            if _CLIENT_ADDR_RE.fullmatch(client) and client not in found:
                found.append(client)
    return found


def parse_key(text: str, user: str) -> str:
    """The key of ``client.<user>`` in ``ceph auth get(-or-create) --format json``."""
    entry = _entry(text, user)
    key = entry.get("key")
    if not isinstance(key, str) or not key:
        raise DriverError(f"ceph auth: no key for client.{user}")
    return key


def parse_caps(text: str, user: str) -> dict[str, str]:
    caps = _entry(text, user).get("caps")
    return {k: v for k, v in caps.items() if isinstance(v, str)} if isinstance(caps, dict) else {}


def _entry(text: str, user: str) -> dict[str, Any]:
    entries = _loads(text, "ceph auth")
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("entity") == f"client.{user}":
            return entry
    raise DriverError(f"ceph auth: no entry for client.{user}")


def _loads(text: str, what: str) -> Any:
    """``text`` as JSON; a ``DriverError`` that never repeats it (``ceph auth`` answers hold keys)."""
    try:
        return json.loads(text)
    except ValueError:
        raise DriverError(f"{what}: an answer that is not JSON") from None


def _json(text: str, what: str) -> dict[str, Any]:
    answer = _loads(text, what)
    if not isinstance(answer, dict):
        raise DriverError(f"{what}: unexpected answer")
    return answer
