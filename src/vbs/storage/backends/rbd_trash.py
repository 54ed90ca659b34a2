"""The trash of an ``rbd`` pool and the removal of volumes: a volume whose image still has
snapshots goes to the RBD trash, and a purge removes what no snapshot keeps any more (and trashes
the images renamed ``vbs-retired-…``); see ``vbs.storage.backends.rbd``."""

from __future__ import annotations

import logging

from vbs.errors import IncorrectState, VbsError
from vbs.storage.backends.rbd_chains import parse_snaps, parse_watchers
from vbs.storage.backends.rbd_cli import EBUSY, ENOENT, ENOTEMPTY, Listing, RbdTools, ToolError

log = logging.getLogger("vbs.storage.backends.rbd")  # the backend's records keep their name


class Trash:
    """Removals and purges in the pool ``cli`` reaches. The caller holds the backend's lock."""

    def __init__(self, cli: RbdTools) -> None:
        self._cli = cli

    def remove_volume(self, volume_id: str) -> None:
        """Remove the volume's image, or trash it while snapshots of it remain (absent is fine)."""
        cli = self._cli
        if cli.image_size(volume_id) is None:
            return
        try:
            cli.rbd("rm", cli.spec(volume_id))
        except ToolError as exc:
            if exc.errno == ENOENT:
                return
            if exc.errno == EBUSY:
                raise IncorrectState(f"The volume '{volume_id}' is still open on a host.") from None
            if exc.errno != ENOTEMPTY:
                raise
            # Its snapshots outlive it (EBS), or clones read deleted ones: to the trash until none is
            # left. `rbd trash mv` takes an image that a client has open, which `rbd rm` refuses: ask.
            if parse_watchers(cli.rbd("status", "--format", "json", cli.spec(volume_id))):
                raise IncorrectState(f"The volume '{volume_id}' is still open on a host.") from None
            cli.rbd("trash", "mv", cli.spec(volume_id))
            log.info("pool %s: volume %s moved to the trash: snapshots of it remain", cli.name, volume_id)
        self.purge_after_removal()  # its parent may have been waiting for its last clone

    def purge(self) -> Listing:
        """Trash the images renamed ``vbs-retired-`` that have snapshots and remove those without,
        then remove every trashed image of VBS that has no snapshot left."""
        cli = self._cli
        listing = cli.listing()
        for image in sorted(listing.retired):
            try:
                snaps = parse_snaps(cli.rbd("snap", "ls", "--all", "--format", "json", cli.spec(image)))
                if snaps:
                    cli.rbd("trash", "mv", cli.spec(image))
                    log.info("pool %s: %s moved to the trash (%d snapshots left)", cli.name, image, len(snaps))
                else:
                    cli.rbd("rm", cli.spec(image))
            except ToolError as exc:
                if exc.errno not in (ENOENT, EBUSY, ENOTEMPTY):
                    raise
        if listing.retired:
            listing = cli.listing()
        for entry in list(listing.trash.values()):
            if entry.kept_for == "nothing":
                cli.rbd_tolerant("trash", "rm", f"{cli.rbd_pool}/{entry.id}", tolerate=(ENOENT, ENOTEMPTY))
                log.info("pool %s: %s (%s) purged from the trash", cli.name, entry.name, entry.id)
                del listing.trash[entry.name]
        return listing

    def purge_after_removal(self) -> None:
        """A purge after a removal, which has happened: a purge that fails (an image another client
        trashed with a later expiry, a cluster that stops answering) is the next pass's to retry."""
        try:
            self.purge()
        except VbsError as exc:
            log.warning("pool %s: purge after a removal failed: %s", self._cli.name, exc.message)
