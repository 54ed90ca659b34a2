"""Partitions and faults on real links, on the namespace cluster of docs/install.md (tests/netns_install.py):
each machine in its own network namespace, TLS on every hop, the guests under TCG.

How a partition is made (src/vbs/rigs/netns.py ``cut``): the machines have neither nftables, iptables, netem
nor tc actions, so two machines are cut from each other alone by pinning, in each, the neighbour entry of
the other's address to a MAC no interface has. Their packets to each other are dropped silently (an open TCP
connection stalls, nothing is reset), and everything else on the bridge flows; ``mend`` deletes the entries
and ARP finds the real MACs again.

- A storage node cut from both controllers while a volume is created on it and a snapshot taken there: both
  operations wait, and finish once the link returns; each ran once (one operation each, the volume's one
  pool file, the snapshot in its store).
- A hypervisor node cut from its storage node while its guest writes numbered blocks, each durable before
  the next: the guest's writes stall (no error) and resume when the link returns; every acknowledged block
  is on the volume, as the guest reads it and in the pool file. Over NBD (stor-1) by default; over iSCSI
  through the TLS tunnels (stor-2) as well under ``make torture``.
- A controller cut from PostgreSQL: the other marks it down and carries every operation, including one the
  cut controller owned; the cut one answers 503 (a client of both controllers goes on to the other), and
  rejoins when the link returns without redoing anything.

After each: ``vbs check`` finds nothing (the DB and the real world agree), no volume is left in a
transitional state, and no volume was attached to two hosts at any sample taken (the DB's attachments and
the storage node's established connections). docs/reliability.md "Partitions on real links" has the
figures.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.installed import Installed
from tests.netns_install import NetnsInstall, netns_cluster
from tests.numbered_blocks import NumberedBlocks

pytestmark = pytest.mark.integration

log = logging.getLogger(__name__)

POOL = "/srv/vbs/pools/default"  # section 7's pool on each storage node
# How long a cut lasts: past a heartbeat (5 s) and an operation lease (15 s), short of the agents' HTTP
# timeout and of a node's heartbeat timeout (30 s each).
CUT_S = 25.0
# 400 blocks of 4 KiB in 401 slots (a prime: stride 97 gives each block its own slot).
BLOCKS = NumberedBlocks(writes=400, slots=401, stride=97)
TRANSITIONAL = {"creating", "deleting", "attaching", "detaching", "pending", "modifying"}


@pytest.fixture(scope="module")
def netns_install(installed: Installed) -> Iterator[NetnsInstall]:
    with netns_cluster(installed) as done:
        yield done


# -- cuts and what is checked after them ---------------------------------------------------------------


@contextmanager
def cut(c: NetnsInstall, pairs: list[tuple[str, str]]) -> Iterator[float]:
    """Each pair of machines cut from each other for the block; mended after it, also when it fails (the
    module's cluster is shared). Yields the monotonic time of the cut."""
    made: list[tuple[str, str]] = []
    try:
        for a, b in pairs:
            c.cluster.cut(c.machines[a].machine, c.machines[b].machine)
            made.append((a, b))
        log.info("netns partitions: cut %s", ", ".join(f"{a} | {b}" for a, b in pairs))
        yield time.monotonic()
    finally:
        for a, b in made:
            c.cluster.mend(c.machines[a].machine, c.machines[b].machine)
        log.info("netns partitions: mended %s", ", ".join(f"{a} | {b}" for a, b in made))


def world_agrees(c: NetnsInstall) -> None:
    """``vbs check`` on the client machine finds nothing (its stores' manifests read too), and no volume is
    left in a transitional state."""
    proc = c.cli("check", check=False)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    assert report["clean"] and proc.returncode == 0, report["findings"]
    vols = c.cli("describe-volumes")["volumes"]
    assert not [v for v in vols if v["status"] in TRANSITIONAL], vols


def pool_files(c: NetnsInstall, node: str, resource_id: str) -> list[str]:
    """The files of ``resource_id`` in ``node``'s pool (final and partial)."""
    pool = c.machines[node].path(POOL)
    return sorted(str(p.relative_to(pool)) for p in pool.rglob(f"*{resource_id}*"))


def stable(c: NetnsInstall, kind: str, resource_id: str, timeout: float, via: str | None = None) -> dict[str, Any]:
    """The volume or snapshot once its status is no longer transitional (asking ``via``'s controller)."""
    collection = {"volume": ("describe-volumes", "volumes"), "snapshot": ("describe-snapshots", "snapshots")}[kind]

    def done() -> dict[str, Any] | None:
        (found,) = c.cli(collection[0], resource_id, via=via)[collection[1]]
        return None if found["status"] in TRANSITIONAL else dict(found)
    return dict(wait_until(done, timeout, 1, what=f"{resource_id} settled"))


def attached_hosts(c: NetnsInstall, volume_id: str) -> list[str]:
    (found,) = c.cli("describe-volumes", volume_id)["volumes"]
    return [a["host"] for a in found["attachments"]]


def export_peers(c: NetnsInstall, node: str, port: int) -> set[str]:
    """The addresses with an established connection to ``node``'s ``port`` (its NBD server or tunnel)."""
    proc = c.cluster.run(c.machines[node].machine, ["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
                         env={"PATH": "/usr/sbin:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return {line.split()[-1].rsplit(":", 1)[0] for line in proc.stdout.splitlines() if line.strip()} - {"127.0.0.1"}


# -- a storage node cut from the controllers -----------------------------------------------------------


def test_a_storage_node_cut_from_the_controllers_during_a_create_and_a_snapshot(netns_install: NetnsInstall) -> None:
    """stor-1 is cut from both controllers (it still reaches the hypervisor nodes); a volume is created on
    it and a snapshot of another of its volumes is taken. Both wait while the cut lasts and finish once it
    is mended; each left exactly its own file in the pool."""
    c = netns_install
    source = c.create("stor-1")
    with cut(c, [("stor-1", "ctl-1"), ("stor-1", "ctl-2")]) as started:
        made = c.cli("create-volume", "--size", "1", "--storage-node", "stor-1")
        snap = c.cli("create-snapshot", source)
        vol = made["volume_id"]
        time.sleep(CUT_S / 2)
        during = {"volume": c.cli("describe-volumes", vol)["volumes"][0]["status"],
                  "snapshot": c.cli("describe-snapshots", snap["snapshot_id"])["snapshots"][0]["status"],
                  "stor-1": [n["state"] for n in c.cli("describe-storage-nodes")["storage_nodes"]
                             if n["name"] == "stor-1"]}
        log.info("netns partitions: %.0f s into the storage node's cut: %s", time.monotonic() - started, during)
        assert during["volume"] == "creating" and during["snapshot"] == "pending", during
        time.sleep(max(0.0, CUT_S - (time.monotonic() - started)))
    mended = time.monotonic()
    found = stable(c, "volume", vol, 300)
    shot = stable(c, "snapshot", snap["snapshot_id"], 300)
    log.info("netns partitions: after the mend, the create ended %s in %.1f s and the snapshot %s",
             found["status"], time.monotonic() - mended, shot["status"])
    assert found["status"] == "available", found
    assert shot["status"] == "completed", shot
    # One operation each, which succeeded (retried across the cut, not begun twice).
    for resource, kind in ((vol, "create-volume"), (snap["snapshot_id"], "create-snapshot")):
        ops = c.operations(resource)
        log.info("netns partitions: %s", ops)
        assert [(o["kind"], o["status"]) for o in ops] == [(kind, "succeeded")], ops
    # The new volume's one file; the snapshot in its store (vbs check reads its manifest) and nothing of
    # it left half-made in the pool.
    assert pool_files(c, "stor-1", vol) == [f"volumes/{vol}.raw"]
    assert not [f for f in pool_files(c, "stor-1", snap["snapshot_id"]) if f.endswith(".partial")]
    world_agrees(c)
    c.cli("delete-snapshot", snap["snapshot_id"], "--wait")
    for v in (vol, source):
        c.cli("delete-volume", v, "--wait")
    world_agrees(c)


# -- a hypervisor node cut from its storage node ---------------------------------------------------------


def start_writer(c: NetnsInstall, dev: str, host: str = "hv-1") -> None:
    """The numbered-block writer in the guest's background; ``/run/acked`` holds how many blocks are durable,
    ``/run/wlog`` its end ("wrote N", or the failure)."""
    script = BLOCKS.writer_script(dev, progress="/run/acked")
    c.guest_run(f"rm -f /run/acked /run/wlog; ( {script} ) > /run/wlog 2>&1 < /dev/null &", host)


def acked(c: NetnsInstall, host: str = "hv-1") -> tuple[int, str]:
    out = c.guest_run("cat /run/acked 2>/dev/null || echo 0; cat /run/wlog 2>/dev/null; true", host)
    first, _, rest = out.strip().partition("\n")
    return int(first or 0), rest.strip()


def blocks_in_guest(c: NetnsInstall, dev: str, host: str = "hv-1") -> set[int]:
    """The numbered blocks the guest reads back from its disk (its caches dropped, O_DIRECT)."""
    out = c.guest_run(f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/{dev} bs={BLOCKS.block} count={BLOCKS.slots} "
                      "iflag=direct 2>/dev/null | tr -c 'A-Z0-9-' '\\n' | grep '^VBS-BLOCK-'", host)
    return {int(m.group(1)) for m in re.finditer(r"VBS-BLOCK-(\d{8})", out)}


def volume_file(c: NetnsInstall, node: str, volume_id: str) -> Path:
    return c.machines[node].path(POOL) / "volumes" / f"{volume_id}.raw"


def guest_writes_across_a_cut(c: NetnsInstall, node: str, port: int) -> None:
    vol = c.create(node)
    c.cli("attach-volume", vol, "--host", "hv-1", "--vm", "vm1", "--wait")
    hv1 = c.machines["hv-1"].machine.address
    try:
        dev = c.guest_disk(vol)
        start_writer(c, dev)
        wait_until(lambda: acked(c)[0] >= 40, 300, 1, what="the guest's first 40 blocks")
        samples: list[tuple[float, int]] = []
        with cut(c, [("hv-1", node)]) as started:
            at_cut = acked(c)[0]
            while time.monotonic() - started < CUT_S:
                samples.append((round(time.monotonic() - started, 1), acked(c)[0]))
                assert attached_hosts(c, vol) == ["hv-1"]
                assert export_peers(c, node, port) <= {hv1}
                time.sleep(2)
            during, failure = acked(c)
        mended = time.monotonic()
        log.info("netns partitions: %s cut from hv-1: %d blocks acked at the cut, samples (s, acked) %s", node,
                 at_cut, samples)
        # The guest's writes stalled: at most the one in flight at the cut completed, and none failed.
        assert during <= at_cut + 1 and not failure, (at_cut, during, failure)
        resumed = wait_until(lambda: acked(c)[0] > during + 5 or None, 300, 0.5, what="the guest writing again")
        log.info("netns partitions: the guest wrote again %.1f s after the mend", time.monotonic() - mended)
        assert resumed
        wait_until(lambda: acked(c)[1].startswith("wrote") or None, 600, 2, what="the writer's end")
        assert acked(c) == (BLOCKS.writes, f"wrote {BLOCKS.writes}")
        everything = set(range(BLOCKS.writes))
        assert blocks_in_guest(c, dev) == everything
        assert attached_hosts(c, vol) == ["hv-1"] and export_peers(c, node, port) == {hv1}
        world_agrees(c)
    finally:
        c.detach(vol)
    assert BLOCKS.blocks_in(volume_file(c, node, vol)) == everything
    c.cli("delete-volume", vol, "--wait")
    world_agrees(c)


def test_a_guest_s_nbd_writes_stall_while_its_host_is_cut_from_the_storage_node_and_none_is_lost(
        netns_install: NetnsInstall) -> None:
    guest_writes_across_a_cut(netns_install, "stor-1", 10809)


@pytest.mark.torture
def test_a_guest_s_iscsi_writes_stall_while_its_host_is_cut_from_the_storage_node_and_none_is_lost(
        netns_install: NetnsInstall) -> None:
    guest_writes_across_a_cut(netns_install, "stor-2", 3260)


# -- a controller cut from PostgreSQL -------------------------------------------------------------------


def controllers(c: NetnsInstall, via: str) -> dict[str, dict[str, Any]]:
    rows = c.cli("describe-controllers", via=via)["controllers"]
    return {r["url"].split("//")[1].split(":")[0]: r for r in rows}


def test_a_controller_cut_from_the_database_stops_acting_and_the_other_takes_over(netns_install: NetnsInstall) -> None:
    """ctl-1 begins a create on stor-1 while stor-1 is cut from it (its call cannot go through), then ctl-1
    is cut from PostgreSQL and stor-1 mended. ctl-2 finds ctl-1 down once its lease is over, adopts the
    create and ends it, and carries every new request; ctl-1 alone answers 503 meanwhile, and a client of
    both is answered by ctl-2. Mended, ctl-1 rejoins and the operation stays as ctl-2 left it."""
    c = netns_install
    ctl1, ctl2 = (c.machines[n].machine.address for n in ("ctl-1", "ctl-2"))
    ctl1_id = controllers(c, "ctl-2")[ctl1]["controller_id"]
    with cut(c, [("stor-1", "ctl-1"), ("stor-1", "ctl-2")]):
        vol = c.cli("create-volume", "--size", "1", "--storage-node", "stor-1", via="ctl-1")["volume_id"]
        time.sleep(2)
    with cut(c, [("ctl-1", "db")]) as started:
        wait_until(lambda: controllers(c, "ctl-2")[ctl1]["state"] == "down" or None, 120, 1, what="ctl-1 down")
        log.info("netns partitions: ctl-1 down as ctl-2 sees it %.1f s after its cut from the database",
                 time.monotonic() - started)
        found = stable(c, "volume", vol, 300, via="ctl-2")
        log.info("netns partitions: ctl-1's create ended %s %.1f s after the cut", found["status"],
                 time.monotonic() - started)
        # ctl-2 carries everything meanwhile: a volume made, attached, written, detached, deleted.
        other = c.cli("create-volume", "--size", "1", "--storage-node", "stor-1", "--wait", via="ctl-2")["volume_id"]
        c.cli("attach-volume", other, "--host", "hv-2", "--vm", "vm2", "--wait", via="ctl-2")
        c.write(other, "fenced", 1, "hv-2")
        c.cli("detach-volume", other, "--wait", via="ctl-2")
        c.cli("delete-volume", other, "--wait", via="ctl-2")
        assert controllers(c, "ctl-2")[ctl1]["state"] == "down"
        # What a client sees meanwhile: ctl-1 alone cannot answer from the database; a client that lists
        # both controllers (ctl-1 first) is answered, by ctl-2.
        asked = time.monotonic()
        alone = c.cli("describe-volumes", vol, check=False, via="ctl-1")
        log.info("netns partitions: ctl-1 alone answered a read in %.1f s: exit %d, %s", time.monotonic() - asked,
                 alone.returncode, alone.stderr.strip()[-300:])
        assert alone.returncode != 0 and "RetryLater" in alone.stderr, alone.stderr  # 503, not a 500
        asked = time.monotonic()
        (listed,) = c.cli("describe-volumes", vol)["volumes"]
        log.info("netns partitions: a client of both controllers was answered in %.1f s", time.monotonic() - asked)
        assert listed["status"] == found["status"]
        (op,) = c.operations(vol)
    log.info("netns partitions: ctl-1's create, as the database holds it: %s", op)
    for name in ("ctl-1", "ctl-2"):
        said = [line for line in (c.runner.logs / f"{name}.log").read_text(errors="replace").splitlines()
                if op["id"] in line or "renew" in line]
        log.info("netns partitions: %s's log of it: %s", name, said[-8:])
    assert op["status"] in ("succeeded", "rolled-back") and op["owner"] != ctl1_id, op
    # Done once: the volume's file exists exactly when the volume does.
    assert pool_files(c, "stor-1", vol) == ([f"volumes/{vol}.raw"] if found["status"] == "available" else []), found
    wait_until(lambda: controllers(c, "ctl-2")[ctl1]["state"] == "up" or None, 120, 1, what="ctl-1 back up")
    time.sleep(5)  # ctl-1's lease loop and retry loop have run since it came back
    assert c.operations(vol) == [op]
    assert {ctl1, ctl2} <= set(controllers(c, "ctl-1"))
    world_agrees(c)
    if found["status"] == "available":
        c.cli("delete-volume", vol, "--wait")
    world_agrees(c)
