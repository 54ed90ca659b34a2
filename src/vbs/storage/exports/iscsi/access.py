"""Who may log in to a target: the names (IQN per key, CHAP user per key and host), the ACL (the
host's initiator name, or its address) and the CHAP accounts in tgtd, bound and unbound without
leaving tgt a hole in its slots."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import secrets
import socket
import string
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESSIV

from vbs.errors import DriverError, InvalidParameter
from vbs.storage.exports.supervised import check_key

from .control import E_ABSENT, AclKind, AdmError, TgtControl
from .state import Grant, LiveTarget, View

_SECRET_ALPHABET = string.ascii_letters + string.digits  # safe in URLs, configs and every initiator
_SECRET_LEN = 24  # iSCSI wants at least 12 (96 bits); 24 alphanumerics are about 143 bits
_CHAP_USER_MAX = 64  # IscsiConnection.chap_user limit


def acl_kind(entry: str) -> AclKind:
    """What an ACL entry is, as tgtd's ``show`` lists it: an initiator name or an address."""
    return "initiator-name" if entry.startswith(("iqn.", "eui.", "naa.")) else "initiator-address"


def acl_entries(grant: Grant, *, by_name: bool) -> list[str]:
    """What the ACL holds for a grant: the host's initiator name where addresses tell no host from
    another (``by_name``: tgtd on loopback, or behind the TLS tunnel where every login comes from
    stunnel on 127.0.0.1) and the host gave one; its addresses otherwise. Never both: tgt admits a
    login whose address OR whose name is bound, so a name next to an address would admit that name
    from any address (measured on tgt 1.0.85; tests/test_iscsi_names.py)."""
    if by_name and grant.initiator_name:
        return [grant.initiator_name]
    return list(grant.addresses)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def new_secret() -> str:
    return "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(_SECRET_LEN))


def acl_addresses(address: str) -> list[str]:
    """Numeric addresses for the ACL: tgt compares numerically (``AI_NUMERICHOST``), never by name."""
    try:
        return [str(ipaddress.ip_address(address))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DriverError(f"cannot resolve host address {address!r} for the iSCSI ACL: {exc}") from exc
    return sorted({str(info[4][0]) for info in infos})


def chap_user(key: str, host_name: str) -> str:
    """The CHAP account of (key, host): readable where it fits, deterministic always.

    tgt accounts are global to the daemon, so the key is part of the name.
    """
    user = f"{key}.{host_name}"
    if len(user) <= _CHAP_USER_MAX:
        return user
    return f"{key}.h{hashlib.sha256(host_name.encode()).hexdigest()[:24]}"


class Access:
    """The ACL entries and CHAP accounts of the targets of one tgtd."""

    def __init__(self, tgt: TgtControl, iqn_prefix: str, state_dir: Path) -> None:
        self._tgt, self.iqn_prefix = tgt, iqn_prefix
        self._state_dir = state_dir
        self._sealer: AESSIV | None = None

    # A target's name reveals nothing: any local user (or any host an ACL admits) may list the names
    # without logging in (tgtd has no discovery authentication), so a name is the key sealed with
    # AES-SIV (deterministic) under a secret of this node, <state_dir>/iqn.key (0600).
    def _names(self) -> AESSIV:
        if self._sealer is None:
            path = self._state_dir / "iqn.key"
            self._state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(secrets.token_bytes(32))
            self._sealer = AESSIV(path.read_bytes()[:32])
        return self._sealer

    def iqn(self, key: str) -> str:
        sealed = base64.b32encode(self._names().encrypt(check_key(key).encode(), None)).decode()
        return f"{self.iqn_prefix}:t{sealed.rstrip('=').lower()}"

    def key_of(self, iqn: str) -> str | None:
        prefix = f"{self.iqn_prefix}:t"
        name = iqn[len(prefix):] if iqn.startswith(prefix) else ""
        try:
            raw = base64.b32decode(name.upper() + "=" * (-len(name) % 8))
            return check_key(self._names().decrypt(raw, None).decode())
        except (ValueError, InvalidTag, InvalidParameter):
            return None  # not ours (an operator's target)

    def create_account(self, grant: Grant, view: View) -> None:
        if grant.user in self._tgt.accounts():
            # An account of that name whose secret is not ours (or not known to be): replace it,
            # unbound everywhere first (deleting a bound account leaves the same hole as below).
            for other in view.values():
                self.unbind_accounts(other, [grant.user])
            self._tgt.delete_account(grant.user)
        # On tgtd's management socket, as every request: tgtadm would take the secret only on its
        # command line, readable in /proc by every local user.
        self._tgt.new_account(grant.user, grant.secret)

    def unbind_acl(self, live: LiveTarget, kind: AclKind, entry: str) -> None:
        try:
            self._tgt.unbind_acl(live, kind, entry)
        except AdmError as exc:
            if not exc.says(E_ABSENT):
                raise
        live.acl.discard(entry)

    def unbind_accounts(self, live: LiveTarget, users: list[str]) -> None:
        """Unbind ``users`` from ``live`` without ever leaving tgtd a hole in its account slots.

        tgt 1.0.85 keeps a target's accounts in an array, an unbind zeroes a slot, and both
        ``--op show`` and the CHAP login read only the first N slots (N = accounts left): a hole
        there makes ``show`` crash tgtd (SIGSEGV) and CHAP refuse the accounts behind it. So the
        accounts are unbound from the last slot backwards and those that stay are bound again
        (binds fill the lowest free slot). Meanwhile the target may have no account, when tgt
        would admit logins without CHAP: the ACL is closed for those milliseconds (new logins
        of the other hosts fail and are retried by their initiators) and restored after.
        """
        going = [u for u in live.accounts if u in users]
        if not going:
            return
        keep = [u for u in live.accounts if u not in going]
        at_tail = live.accounts[len(keep):] == going
        unbind = going if at_tail else list(live.accounts)
        closed = sorted(live.acl) if not keep or not at_tail else []
        for entry in closed:
            self.unbind_acl(live, acl_kind(entry), entry)
        for user in reversed(unbind):
            try:
                self._tgt.unbind_account(live, user)
            except AdmError as exc:
                if not exc.says(E_ABSENT):
                    raise
            live.accounts.remove(user)
        for user in keep:
            if user not in live.accounts:
                self._tgt.bind_account(live, user)
                live.accounts.append(user)
        if keep:
            for entry in closed:
                self._tgt.bind_acl(live, acl_kind(entry), entry)
                live.acl.add(entry)

    def forget_account(self, live: LiveTarget, user: str, view: View) -> None:
        """Delete an unbound account of this target's key once no target holds it."""
        key = self.key_of(live.iqn)
        if key and user.startswith(f"{key}.") and not any(
            user in t.accounts for t in view.values()
        ):
            try:
                self._tgt.delete_account(user)
            except AdmError as exc:
                if not exc.says(E_ABSENT):
                    raise
