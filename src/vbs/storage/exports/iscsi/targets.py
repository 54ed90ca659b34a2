"""tgtd's targets made to match the desired state: a target per key with its tuning, its LUNs
(made, set read-only, deleted once idle), then accounts and ACL in the safe order; teardown."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from functools import partial
from pathlib import Path

from vbs.errors import DriverError
from vbs.storage.copy import punches_holes

from .access import Access, acl_entries, acl_kind
from .control import E_ABSENT, E_ACTIVE, AdmError, TgtControl
from .state import Export, LiveLun, LiveTarget, View

log = logging.getLogger(__name__)

# Larger PDUs and unsolicited data: measured to double write throughput (MACHINE-FACTS).
TUNING: tuple[tuple[str, str], ...] = (
    ("MaxRecvDataSegmentLength", "262144"),
    ("MaxXmitDataSegmentLength", "262144"),
    ("FirstBurstLength", "262144"),
    ("MaxBurstLength", "1048576"),
    ("InitialR2T", "No"),
)


class Targets:
    """Applies each key's desired target to tgtd, and removes targets."""

    def __init__(self, tgt: TgtControl, access: Access, save: Callable[[], None], *, direct_io: bool,
                 session_grace: float, by_name: bool) -> None:
        """``by_name``: bind the hosts' initiator names rather than their addresses (see
        ``access.acl_entries``)."""
        self.direct_io, self.session_grace, self.by_name = direct_io, session_grace, by_name
        self._no_direct_told = False  # a file system without O_DIRECT: said once, with what it means
        self._punches: dict[str, bool] = {}  # per directory of backing files: whether it punches holes
        self._tgt, self._access, self._save = tgt, access, save

    def apply(self, exp: Export, view: View, *, fresh_users: AbstractSet[str] = frozenset(),
              tune: bool = False) -> None:
        """Make tgtd's target for ``exp`` match it; ``view`` is updated as tgtd changes.

        ``fresh_users``: accounts whose secret is new, re-created even if tgtd has an account of
        that name (left by a lost state: its secret is unknown). ``tune``: set the negotiation
        parameters even on an existing target.
        """
        iqn = self._access.iqn(exp.key)
        live = view.get(iqn)
        created = live is None
        if live is None:
            tid = max((t.tid for t in view.values()), default=0) + 1
            self._tgt.new_target(tid, iqn)
            live = view[iqn] = LiveTarget(tid=tid, iqn=iqn)
        try:
            if self._apply_target(exp, live, view, fresh_users=fresh_users, tune=tune or created):
                self._save()  # the sizes of new LUNs, which a refresh compares with the file's
        except DriverError:
            if created:  # no half-made target: the caller sees the error, tgtd sees nothing
                try:
                    self.teardown(exp.key, view, grace=0.0)
                except DriverError as exc:
                    log.error("could not remove the half-made target %s: %s", iqn, exc.message)
            raise

    def _apply_target(self, exp: Export, live: LiveTarget, view: View, *,
                      fresh_users: AbstractSet[str], tune: bool) -> bool:
        """Returns whether ``exp.lun_sizes`` changed."""
        sizes_changed = False
        # Nothing below lets an initiator in before the ACL exists, and the ACL comes last: a LUN
        # is never visible writable when it should be read-only, nor without CHAP.
        if tune:
            for name, value in TUNING:
                self._tgt.set_param(live, name, value)
        wanted = exp.wanted_luns()
        for n in sorted(wanted):
            lun = live.luns.get(n)
            if lun is None:
                store = exp.backing_store()
                if exp.rbd is None and self.direct_io and self._direct_ok(exp.path):
                    store += (("bsoflags", "direct"),)
                size = self.store_size(exp)  # what tgtd reads as it opens the store just below
                self._tgt.new_lun(live, n, store)
                lun = live.luns[n] = LiveLun(path=exp.store_path())
                # ensure_export records the size in its own save, before the LUN is made: a second
                # save only if the file changed in between (or a restart makes the LUN again).
                sizes_changed = exp.lun_sizes.get(n) != size or sizes_changed
                exp.lun_sizes[n] = size
            elif lun.path != exp.store_path():
                raise DriverError(f"target {live.iqn} serves {lun.path} as LUN {n}, not {exp.store_path()}")
            # Thin provisioning lets an initiator zero or discard a range without sending its zeros:
            # QEMU's write-zeroes becomes a WRITE SAME with UNMAP (a mirror onto this LUN skips the
            # source's holes; 1 GiB of zeros took 96 s over a tunnel without it) and a guest's TRIM
            # frees space, as the NBD export's discard=unmap does. Only where the file system punches holes:
            # elsewhere tgtd would fail those commands.
            thin = exp.rbd is None and self._punch_ok(exp.path)
            if lun.readonly != exp.read_only or lun.thin != thin:
                # tgt takes no params at LUN creation: they are an update right after it.
                self._tgt.set_lun_params(live, n, (("readonly", str(int(exp.read_only))),
                                                   ("thin_provisioning", str(int(thin)))))
                lun.readonly, lun.thin = exp.read_only, thin
        deadline = time.monotonic() + self.session_grace
        for n in sorted(set(live.luns) - wanted - {0}):  # LUN 0 is tgt's controller
            # A LUN no host may use any more (retired after a refresh, or its last host removed).
            # A client still on it gets I/O errors, not a hang.
            self._until_idle(deadline, partial(self._tgt.delete_lun, live, n))
            live.luns.pop(n, None)
            sizes_changed = exp.lun_sizes.pop(n, None) is not None or sizes_changed

        want_users = {g.user: g for g in exp.grants.values()}
        # Recomputed from the grants at every apply: a state file written before names were bound
        # gets them at the next reconcile (agent start, check()).
        want_acl = {a for g in exp.grants.values() for a in acl_entries(g, by_name=self.by_name)}
        # Accounts before the ACL opens: a target with an ACL entry and no account admits logins
        # without CHAP.
        stale = [u for u in live.accounts if u not in want_users or u in fresh_users]
        self._access.unbind_accounts(live, stale)
        for user in stale:
            if user not in want_users:
                self._access.forget_account(live, user, view)
        for user, grant in sorted(want_users.items()):
            if user in live.accounts:
                continue
            self._access.create_account(grant, view)
            self._tgt.bind_account(live, user)
            live.accounts.append(user)
        for entry in sorted(want_acl - live.acl):
            self._tgt.bind_acl(live, acl_kind(entry), entry)
            live.acl.add(entry)
        for entry in sorted(live.acl - want_acl):
            # Whatever else is bound (by hand, or the addresses a name replaces) would widen access.
            self._access.unbind_acl(live, acl_kind(entry), entry)
        return sizes_changed

    def free_lun(self, exp: Export, view: View) -> int:
        """The lowest LUN number of the key's target that no grant names and tgtd does not have."""
        live = view.get(self._access.iqn(exp.key))
        taken = exp.wanted_luns() | (set(live.luns) if live is not None else set())
        free = [n for n in range(1, 256) if n not in taken]
        if not free:
            raise DriverError(f"target {self._access.iqn(exp.key)} has no free LUN number")
        return free[0]

    @staticmethod
    def store_size(exp: Export) -> int:
        """The bytes a LUN of ``exp`` made now would have."""
        if exp.rbd is not None:
            return exp.image_size
        try:
            return os.stat(exp.path).st_size
        except OSError as exc:
            raise DriverError(f"source file {exp.path} of {exp.key}: {exc.strerror}") from exc

    def _punch_ok(self, path: str) -> bool:
        directory = os.path.dirname(path)
        if directory not in self._punches:
            self._punches[directory] = punches_holes(Path(directory))
            if not self._punches[directory]:
                log.info("%s: this file system does not punch holes, so its LUNs are not thin-provisioned: "
                         "zeros written by initiators are sent and stored", directory)
        return self._punches[directory]

    def _direct_ok(self, path: str) -> bool:
        """Whether the file system takes O_DIRECT (tmpfs before Linux 6.6 does not; tgtd would then fail the LUN)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                if self._no_direct_told:
                    log.debug("%s: no O_DIRECT, served through the page cache", path)
                else:
                    self._no_direct_told = True
                    log.info("%s: this file system refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE and network "
                             "file systems), so tgtd serves its files through the page cache instead of bsoflags="
                             "direct: the initiators' flushes (SYNCHRONIZE CACHE) still reach the disk. Nothing needs "
                             "doing (said once per export driver)", path)
                return False
            return True  # let tgtd report the real problem
        os.close(fd)
        return True

    def teardown(self, key: str, view: View, *, grace: float) -> None:
        """Remove the target of ``key``: ACL first (no new logins), then accounts, LUNs and
        the target itself, which tgtd refuses while a session is logged in (never forced)."""
        iqn = self._access.iqn(key)
        live = view.get(iqn)
        if live is None:
            return
        for entry in sorted(live.acl):
            self._access.unbind_acl(live, acl_kind(entry), entry)
        users = list(live.accounts)
        self._access.unbind_accounts(live, users)
        for user in users:
            self._access.forget_account(live, user, view)
        deadline = time.monotonic() + grace
        try:
            for lun in sorted(n for n in live.luns if n != 0):  # LUN 0 is tgt's controller
                # Without its LUN a lingering client gets I/O errors, not a hang.
                self._until_idle(deadline, partial(self._tgt.delete_lun, live, lun))
                live.luns.pop(lun, None)
            self._until_idle(deadline, partial(self._tgt.delete_target, live))
        except AdmError as exc:
            if exc.says(E_ACTIVE):
                sessions = ", ".join(live.sessions) or "an initiator"
                raise DriverError(
                    f"target {iqn} still has a session logged in ({sessions}): unplug the disk on "
                    "that host first; the removal completes at the next remove or check") from exc
            raise
        del view[iqn]

    @staticmethod
    def _until_idle(deadline: float, delete: Callable[[], None]) -> None:
        """Run a delete, retrying while tgtd says "still active" (in-flight I/O, a session logging
        out) until ``deadline``; "already gone" is success."""
        while True:
            try:
                delete()
                return
            except AdmError as exc:
                if exc.says(E_ABSENT):
                    return
                if not exc.says(E_ACTIVE) or time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)
