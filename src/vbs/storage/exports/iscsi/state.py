"""What the iSCSI driver wants tgtd to serve (targets, LUNs and grants, kept in ``exports.json``)
and what tgtd reports it serves (its answer to ``--mode target --op show`` parsed). No I/O here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from vbs.storage.exports.supervised import ServedKey
from vbs.storage.exports.tgt_ipc import Value

LUN = 1
STATE_VERSION = 2


# -- desired state --------------------------------------------------------------------------------


class Grant(BaseModel):
    """One host's access to one key: its ACL addresses and its CHAP account."""

    host: str
    address: str  # as the host identity gave it
    addresses: list[str]  # numeric, what the ACL holds (resolved once, not at every check)
    initiator_name: str | None  # bound instead of the addresses where tgtd is on loopback; fixed per grant
    user: str
    secret: str
    lun: int = LUN  # the LUN this host is given
    old_luns: list[int] = Field(default_factory=list)  # LUNs it may still use until retire_exports


class Export(ServedKey):
    """One key as it should be served: one target, its LUNs, one grant per host."""

    read_only: bool
    grants: dict[str, Grant] = Field(default_factory=dict)
    lun: int = LUN  # the newest LUN: a host that joins gets this one
    lun_sizes: dict[int, int] = Field(default_factory=dict)  # file size when tgtd made each LUN
    # An RBD source's size as its backend last read it (tgtd's rbd backing store opens the image
    # itself; there is no file to stat).
    image_size: int = 0

    def backing_store(self) -> tuple[tuple[str, Value], ...]:
        """The backing store of a LUN of this key, as tgtd takes it (tgtadm's ``--backing-store``,
        ``--bstype``, ``--bsopts``): a file read and written directly, or an RBD image that tgtd's
        rbd backing store (Debian's tgt-rbd) opens with librbd as the cephx user, whose key it reads
        from the keyring the conf names."""
        if self.rbd is None:
            return (("path", self.path), ("bstype", "rdwr"))
        return (("path", f"{self.rbd.pool}/{self.rbd.image}"), ("bstype", "rbd"),
                ("bsopts", (("conf", self.rbd.conf), ("id", self.rbd.user))))

    def store_path(self) -> str:
        """What tgtd's ``show`` reports as the LUN's backing store path."""
        return self.path if self.rbd is None else f"{self.rbd.pool}/{self.rbd.image}"

    def wanted_luns(self) -> set[int]:
        return {n for g in self.grants.values() for n in (g.lun, *g.old_luns)} or {self.lun}


def upgrade_v1(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Version 1 keyed exports by ``volume_id`` and listed grants; the same facts otherwise."""
    items: list[dict[str, Any]] = []
    for old in data["exports"]:
        item = {k: v for k, v in old.items() if k not in ("volume_id", "grants")}
        items.append({**item, "key": old["volume_id"], "grants": {g["host"]: g for g in old["grants"]}})
    return items


# -- what tgtd reports ----------------------------------------------------------------------------


@dataclass
class LiveLun:
    path: str = ""
    readonly: bool = False
    thin: bool = False  # UNMAP and WRITE SAME with UNMAP punch holes in the backing file


@dataclass
class LiveTarget:
    tid: int
    iqn: str
    luns: dict[int, LiveLun] = field(default_factory=dict)
    accounts: list[str] = field(default_factory=list)  # in tgtd's slot order (see access.unbind_accounts)
    acl: set[str] = field(default_factory=set)  # addresses and initiator names alike
    sessions: list[str] = field(default_factory=list)  # "initiator@address", for messages


def parse_targets(text: str) -> dict[str, LiveTarget]:
    """Parse tgtd's answer to ``--mode target --op show`` (what ``tgtadm`` prints) into targets by IQN
    (the stable key: tids are not)."""
    targets: dict[str, LiveTarget] = {}
    cur: LiveTarget | None = None
    section = ""
    lun: LiveLun | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        m = re.fullmatch(r"Target (\d+): (\S+)", line)
        if m:
            cur = LiveTarget(tid=int(m.group(1)), iqn=m.group(2))
            targets[cur.iqn] = cur
            section, lun = "", None
            continue
        if cur is None:
            continue
        if indent == 4:
            section = body.rstrip(":")
        elif section == "LUN information":
            if indent == 8 and body.startswith("LUN: "):
                lun = cur.luns.setdefault(int(body[5:]), LiveLun())
            elif lun is not None and body.startswith("Backing store path: "):
                lun.path = body[len("Backing store path: "):]
            elif lun is not None and body.startswith("Readonly: "):
                lun.readonly = body.endswith("Yes")
            elif lun is not None and body.startswith("Thin-provisioning: "):
                lun.thin = body.endswith("Yes")
        elif section == "Account information" and indent == 8:
            if not body.endswith("(outgoing)"):
                cur.accounts.append(body)
        elif section == "ACL information" and indent == 8:
            cur.acl.add(body)
        elif section == "I_T nexus information":
            if body.startswith("Initiator: "):
                cur.sessions.append(body[len("Initiator: "):].split(" alias:")[0])
            elif body.startswith("IP Address: ") and cur.sessions:
                cur.sessions[-1] += "@" + body[len("IP Address: "):]
    return targets


View = dict[str, LiveTarget]  # what tgtd serves, by IQN


def parse_portals(text: str) -> set[str]:
    return {line.split("Portal: ", 1)[1].rsplit(",", 1)[0] for line in text.splitlines() if "Portal: " in line}
