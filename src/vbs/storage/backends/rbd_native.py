"""The cephx side of native RBD attachments: a user per attachment whose caps reach the image's
objects only (caps from ``rbd_access``), its key, its removal with its clients cut off, and the
cluster's monitors as hosts reach them."""

from __future__ import annotations

import logging

from vbs.errors import DriverError, NotFound
from vbs.storage.backends import rbd_access
from vbs.storage.backends.rbd_cli import EINVAL, ENOENT, RbdTools, ToolError
from vbs.wire.storage import ExportInfo

log = logging.getLogger(__name__)

# How long a client still connected as a removed attachment user stays blocklisted: past the life of
# any ticket it holds (auth service ticket ttl, 1 h by default), after which it cannot authenticate.
BLOCKLIST_S = 7200


class CephxAttachments:
    """The attachment users of one pool, through its tools."""

    def __init__(self, cli: RbdTools) -> None:
        self._cli = cli
        self._monitor_list: list[str] | None = None

    def remove_user(self, volume_id: str, user: str) -> None:
        """Cut the user's clients off, then remove it (absent is fine)."""
        self._cut_sessions(user)
        self._cli.tool("ceph", "auth", "rm", f"client.{user}")  # exits 0 when the user does not exist
        log.info("volume %s: cephx user client.%s removed", volume_id, user)

    def _cut_sessions(self, user: str) -> None:
        """Blocklist the clients still connected as ``user`` (a forced detach of a host that did not
        answer: its QEMU may still have the image open). A removed user's connected clients keep
        their tickets until they expire; a blocklisted client's OSD requests fail at once."""
        entity = f"client.{user}"
        for mon in rbd_access.parse_mon_names(self._cli.tool("ceph", "mon", "dump", "--format", "json")):
            try:
                sessions = rbd_access.parse_sessions(
                    self._cli.tool("ceph", "tell", f"mon.{mon}", "sessions", "--format", "json"), entity)
            except DriverError as exc:  # a monitor down: its clients hunt for another one
                log.warning("pool %s: sessions of mon.%s not read: %s", self._cli.name, mon, exc)
                continue
            for client in sessions:
                self._cli.tool("ceph", "osd", "blocklist", "add", client, str(BLOCKLIST_S))
                log.warning("pool %s: %s was still connected as %s: blocklisted", self._cli.name, client, entity)

    def users(self) -> list[ExportInfo]:
        """The attachments' cephx users of this pool's images, as the reconciler sees exports."""
        answer = self._cli.tool("ceph", "auth", "ls", "--format", "json")  # holds every key: never logged
        return rbd_access.parse_attachment_users(answer, self._cli.rbd_pool)

    def image_chain(self, volume_id: str) -> list[rbd_access.ImageRef]:
        """The volume's image and its parents (a clone's), each found by id."""
        cli = self._cli
        try:
            chain = [rbd_access.parse_image_ref(cli.rbd("info", "--format", "json", cli.spec(volume_id)),
                                                cli.rbd_pool)]
        except ToolError as exc:
            if exc.errno == ENOENT:
                raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound") from None
            raise
        while (parent := chain[-1].parent) is not None:
            if len(chain) > rbd_access.MAX_CLONE_CHAIN:
                raise DriverError(f"pool {cli.name}: volume {volume_id} has more than "
                                  f"{rbd_access.MAX_CLONE_CHAIN} parents")
            pool, namespace, image_id = parent
            where = ["--pool", pool] + (["--namespace", namespace] if namespace else [])
            chain.append(rbd_access.parse_image_ref(
                cli.rbd("info", "--format", "json", *where, "--image-id", image_id), pool, namespace))
        return chain

    def cephx_key(self, user: str, osd_caps: str) -> str:
        """The key of ``client.<user>`` with exactly these caps, made if it is absent (idempotent).
        It comes on the tool's stdout, never an argv or a log."""
        entity = f"client.{user}"
        caps = ["mon", rbd_access.MON_CAPS, "osd", osd_caps]
        try:
            answer = self._cli.tool("ceph", "auth", "get-or-create", entity, *caps, "--format", "json")
        except ToolError as exc:
            if exc.errno != EINVAL:
                raise
            # It exists with other caps (the image's parents changed, or its mode): set these.
            self._cli.tool("ceph", "auth", "caps", entity, *caps)
            answer = self._cli.tool("ceph", "auth", "get-or-create", entity, *caps, "--format", "json")
        return rbd_access.parse_key(answer, user)

    def attachment_caps(self, volume_id: str, host_name: str) -> dict[str, str] | None:
        """The caps of the host's cephx user of this volume, None if it has none (an export then)."""
        user = rbd_access.attachment_user(host_name, volume_id)
        try:
            return rbd_access.parse_caps(self._cli.tool("ceph", "auth", "get", f"client.{user}", "--format", "json"),
                                         user)
        except ToolError as exc:
            if exc.errno == ENOENT:
                return None
            raise

    def monitors(self) -> list[str]:
        """The cluster's monitors as hosts reach them (read once: a monitor map rarely changes, and
        the agent's heartbeat reports these)."""
        if self._monitor_list is None:
            self._monitor_list = rbd_access.parse_monitors(self._cli.tool("ceph", "mon", "dump", "--format", "json"))
        return self._monitor_list
