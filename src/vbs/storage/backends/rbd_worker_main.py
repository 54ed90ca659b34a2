"""The rbd backend's long-lived worker: one rados connection, requests as JSON lines.

Run by the system Python (``/usr/bin/python3 -I this-file``: Debian's python3-rados and python3-rbd
live there, not in the agent's venv), so it imports nothing but the standard library and those two.
Its argv: the ceph.conf, the cephx user, the pool and the per-call timeout in seconds: no secret; the
key is read by librados from the keyring the conf names, as the ``rbd`` tool does. On start it
connects and answers ``{"ready": true}`` (or exits: 3 when the bindings are missing, 4 when it
cannot connect, with ``{"errno": n, "error": "..."}`` first if it can say why). Then each line on
stdin is a request ``{"op": ..., ...}`` and each answer one line: ``{"out": <what rbd --format json
prints>}`` or ``{"errno": n, "error": "..."}`` (the errno the ``rbd`` tool would exit with). EOF on
stdin ends it. The agent kills it by PID when an answer overruns the timeout (``rbd_worker``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

EXIT_NO_BINDINGS, EXIT_NO_CONNECTION = 3, 4
_NAMESPACES = {0: "user", 1: "group", 2: "trash", 3: "mirror"}
EINVAL = 22

# The bindings, imported by main() (importing this module elsewhere does nothing).
rados: Any = None
rbd: Any = None
_OUT: Any = None


def _send(answer: dict[str, Any]) -> None:
    _OUT.write(json.dumps(answer) + "\n")
    _OUT.flush()


def _image(ioctx: Any, req: dict[str, Any], *, read_only: bool) -> Any:
    if "image_id" in req:
        return rbd.Image(ioctx, image_id=str(req["image_id"]), read_only=read_only)
    return rbd.Image(ioctx, str(req["image"]), read_only=read_only)


def _snaps(image: Any) -> list[dict[str, Any]]:
    return [{"id": s["id"], "name": s["name"], "size": s["size"],
             "namespace": {"type": _NAMESPACES.get(s.get("namespace", 0), "unknown")}}
            for s in image.list_snaps()]


def _parent(cluster: Any, ioctx: Any, image: Any) -> dict[str, Any] | None:
    """The parent as ``rbd info`` shows it. The bindings give no parent id nor trash flag in the
    spec: the id comes from ``parent_id()``, the flag from whether the parent's pool has it in its trash."""
    try:
        p = image.get_parent_image_spec()
        parent_id = image.parent_id()
    except rbd.ImageNotFound:
        return None
    pool, namespace = p["pool_name"], p["pool_namespace"]
    same = pool == ioctx.get_pool_name() and namespace == ioctx.get_namespace()
    where = ioctx if same else cluster.open_ioctx(pool)
    try:
        if not same:
            where.set_namespace(namespace)
        try:
            rbd.RBD().trash_get(where, parent_id)
            trashed = True
        except rbd.ImageNotFound:
            trashed = False
    finally:
        if not same:
            where.close()
    return {"pool": pool, "pool_namespace": namespace, "image": p["image_name"], "id": parent_id,
            "snapshot": p["snap_name"], "trash": trashed}


def _list_long(cluster: Any, ioctx: Any) -> list[dict[str, Any]]:
    """What ``rbd ls -l --format json`` says of each image: name, size, parent; then its user snapshots."""
    out: list[dict[str, Any]] = []
    for name in rbd.RBD().list(ioctx):
        try:
            with rbd.Image(ioctx, name, read_only=True) as image:
                entry: dict[str, Any] = {"image": name, "id": image.id(), "size": image.size(), "format": 2}
                parent = _parent(cluster, ioctx, image)
                if parent is not None:
                    entry["parent"] = parent
                out.append(entry)
                for s in image.list_snaps():
                    if s.get("namespace", 0) == 0:
                        out.append({"image": name, "id": entry["id"], "snapshot": s["name"],
                                    "snapshot_id": s["id"], "size": s["size"], "format": 2})
        except rbd.ImageNotFound:
            continue  # removed meanwhile, as the rbd tool skips it
    return out


# The ops that change one snapshot: the librbd ``Image`` method each calls with the snapshot's name.
_SNAP_CHANGES = {"snap_create": "create_snap", "snap_remove": "remove_snap", "snap_unprotect": "unprotect_snap"}


def serve(cluster: Any, ioctx: Any, req: dict[str, Any]) -> Any:
    op = req.get("op")
    change = _SNAP_CHANGES.get(str(op))
    if change is not None:
        with _image(ioctx, req, read_only=False) as image:
            getattr(image, change)(str(req["snap"]))
        return None
    if op == "snap_list":
        with _image(ioctx, req, read_only=True) as image:
            return _snaps(image)
    if op == "list_long":
        return _list_long(cluster, ioctx)
    if op == "trash_list":
        return [{"id": e["id"], "name": e["name"]} for e in rbd.RBD().trash_list(ioctx)]
    raise ValueError(f"unknown op {op!r}")


def main(argv: list[str]) -> int:
    global rados, rbd, _OUT  # noqa: PLW0603 - set once, before any request
    try:
        import rados as rados_module  # type: ignore[import-not-found, unused-ignore]
        import rbd as rbd_module  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return EXIT_NO_BINDINGS
    rados, rbd = rados_module, rbd_module
    # The answers go to a copy of stdout; fd 1 itself becomes stderr, so nothing a C library prints
    # there can be taken for an answer.
    _OUT = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    conf, user, pool, timeout = argv[1], argv[2], argv[3], int(argv[4])
    try:
        cluster = rados.Rados(conffile=conf, rados_id=user)
        for option in ("rados_mon_op_timeout", "rados_osd_op_timeout", "client_mount_timeout"):
            cluster.conf_set(option, str(timeout))
        cluster.connect(timeout=timeout)
        ioctx = cluster.open_ioctx(pool)
    except rados.Error as exc:
        _send({"errno": getattr(exc, "errno", None) or EINVAL, "error": str(exc)[:500]})
        return EXIT_NO_CONNECTION
    _send({"ready": True})
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"out": serve(cluster, ioctx, json.loads(line))}
        except (rbd.Error, rados.Error) as exc:
            answer = {"errno": getattr(exc, "errno", None) or EINVAL, "error": str(exc)[:500]}
        except (ValueError, KeyError, TypeError) as exc:
            answer = {"errno": EINVAL, "error": f"bad request: {exc}"[:500]}
        _send(answer)
    ioctx.close()
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
