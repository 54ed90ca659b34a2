"""A rolling upgrade from the previous release to this tree, both real installs.

The first release, 0.1.0, is built from its commit in this repository's history (tests/installed.py
``FIRST_RELEASE``; the test fails, saying what to fetch, where the history lacks it) and this tree's wheel
as tests/test_install.py builds it, each installed into its own venv of Debian's python3. One install
(tests/installed_cluster.py: its services started by their units' ``ExecStart``, mutual TLS from its CA, on
loopback, its metadata on a real PostgreSQL) then goes from 0.1.0 to this release as docs/install.md
("Upgrades") orders it: ``vbs db upgrade`` of the new release ahead of the controllers (refused while they
run unless ``--force``, for a release whose migrations only add), the controller, then the storage agent
and the host agent one at a time, with a volume attached under 0.1.0 to a running guest (``vbs demo-vm``)
that reads and writes it throughout. The reverse mix, agents of this release under a 0.1.0 controller,
runs too.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.installed import FIRST_RELEASE, ROLES, Installed
from tests.installed_cluster import Install, new_install
from tests.postgres_cluster import PostgresForTests
from vbs.ids import virtio_serial
from vbs.rigs.testguest import default_cache_dir, pattern_sha256
from vbs.rigs.testguest.background import BackgroundGuest
from vbs.versions import UNVERSIONED_RELEASE, UNVERSIONED_WIRE, WIRE_VERSION

pytestmark = pytest.mark.integration

MIB = 4  # what the guest writes and reads back, in MiB


def first_release_install(first: Installed, current: Installed, d: Path, database_url: str) -> Install:
    """An install of 0.1.0 (nothing started yet), made as its operator would with 0.1.0's commands, but for
    the first access key: 0.1.0 has no ``vbs bootstrap-key`` (its ``vbs up`` wrote the key), so this
    release's makes the files 0.1.0 reads (credentials, node-secret, master.key)."""
    old = new_install(first, d, database_url)
    old.of(current).vbs("bootstrap-key", "--data-dir", f"{d}/controller")
    old.issue_credentials()
    old.vbs("db", "upgrade", "--config", str(old.config))
    return old


@pytest.fixture
def first_release(installed_first_release: Installed, installed: Installed, postgres: PostgresForTests,
                  tmp_path: Path) -> Iterator[Install]:
    """0.1.0's three services running (they stop, whichever release runs them by then, at the end)."""
    old = first_release_install(installed_first_release, installed, tmp_path, postgres.new_database())
    try:
        for role in ROLES:
            old.start(role)
        old.wait_up()
        yield old
    finally:
        old.stop_all()


@pytest.fixture
def guest(first_release: Install, installed: Installed) -> Iterator[BackgroundGuest]:
    """A running VM on host-1 (``vbs demo-vm``: the test guest under QEMU, its QMP socket where the host agent
    finds VMs), stopped by its PID at the end."""
    vm = BackgroundGuest("vm1", first_release.dir / "host")
    demo = first_release.of(installed)
    demo.env = {**demo.env, "VBS_CACHE_DIR": str(default_cache_dir().parent)}
    try:
        demo.vbs("demo-vm", vm.name, "--data-dir", str(first_release.dir / "host"))
        yield vm
    finally:
        vm.stop()


def in_guest(vm: BackgroundGuest, command: str) -> str:
    status, out = vm.run(command, 300)
    assert status == 0, f"{command}: {status} {out}"
    return out


def guest_disk(vm: BackgroundGuest, volume_id: str) -> str:
    """The guest's device of ``volume_id`` (found by its serial), once the guest sees it."""
    serial = virtio_serial(volume_id)
    return str(wait_until(lambda: next((d.device for d in vm.disks() if d.serial == serial), None), 120, 1,
                          what=f"{volume_id} in the guest"))


def write_in_guest(vm: BackgroundGuest, volume_id: str, seed: str) -> None:
    """``pattern_bytes(seed, MIB)`` written by the guest to its disk of ``volume_id`` (flushed)."""
    dev = guest_disk(vm, volume_id)
    in_guest(vm, f"yes {seed} | head -c {MIB << 20} | dd of=/dev/{dev} bs=1M conv=fsync 2>/dev/null")


def read_in_guest(vm: BackgroundGuest, volume_id: str) -> str:
    """sha256 of the first ``MIB`` MiB of its disk of ``volume_id``, as the guest reads it from the disk."""
    dev = guest_disk(vm, volume_id)
    return in_guest(vm, f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/{dev} bs=1M count={MIB} 2>/dev/null | "
                        "sha256sum").split()[0]


def schema(inst: Install) -> tuple[str, str]:
    """(the database's schema revision, the newest that ``inst``'s vbs knows), as ``vbs db status`` says."""
    said = inst.vbs("db", "status", "--config", str(inst.config), check=False).stdout
    found = re.search(r"schema revision (\S+), this VBS's newest (\S+)\n", said)
    assert found is not None, said
    return found[1], found[2]


def made_and_deleted(inst: Install) -> None:
    """A volume made on storage-1 and deleted, through ``inst``'s CLI: the controller's calls to the agent
    and the agent's work, whole."""
    volume_id = inst.json("create-volume", "--size", "1", "--wait")["volume_id"]
    (made,) = inst.json("describe-volumes", volume_id)["volumes"]
    assert (made["status"], made["storage_node"]) == ("available", "storage-1"), made
    volume_file = inst.dir / "pools" / "default" / "volumes" / f"{volume_id}.raw"
    assert volume_file.stat().st_size == 1 << 30
    inst.vbs("delete-volume", volume_id, "--wait")
    (gone,) = inst.json("describe-volumes", volume_id)["volumes"]
    assert gone["status"] == "deleted" and not volume_file.exists()


def versions_shown(inst: Install) -> dict[str, tuple[str | None, int | None]]:
    """The release and wire version of each node that is up, as ``describe-storage-nodes`` and
    ``describe-hosts`` show them."""
    nodes = [*inst.json("describe-storage-nodes")["storage_nodes"], *inst.json("describe-hosts")["hosts"]]
    return {n["name"]: (n["vbs_version"], n["wire_version"]) for n in nodes if n["state"] == "up"}


def heard_since(inst: Install, since: datetime) -> bool:
    """Whether both nodes' last heartbeats, as the controller recorded them, came after ``since``."""
    nodes = [inst.node("storage_nodes", "storage-1"), inst.node("hosts", "host-1")]
    return all(n is not None and datetime.fromisoformat(n["last_heartbeat"]) > since for n in nodes)


def restart(inst: Install, role: str) -> None:
    """Stop the service of ``role`` (whichever release runs it) and start ``inst``'s in its place, on the same
    config and state, as a package upgrade and a ``systemctl restart`` do."""
    inst.stop(role)
    inst.start(role)


def test_a_rolling_upgrade_from_0_1_0_keeps_every_volume_served(first_release: Install, installed: Installed,
                                                                 guest: BackgroundGuest) -> None:
    old, new = first_release, first_release.of(installed)
    release = installed.version
    # Under 0.1.0: a volume attached to a running guest, which writes to it; it stays attached throughout.
    kept = old.json("create-volume", "--size", "1", "--wait")["volume_id"]
    kept_file = old.dir / "pools" / "default" / "volumes" / f"{kept}.raw"
    wait_until(lambda: any(i["vm_id"] == guest.name and i["state"] == "running"
                           for i in old.json("describe-instances")["instances"]), 180, 1, what="vm1 on host-1")
    old.vbs("attach-volume", kept, "--host", "host-1", "--vm", guest.name, "--wait")
    write_in_guest(guest, kept, "old")
    assert read_in_guest(guest, kept) == pattern_sha256("old", MIB)
    old_head, new_head = schema(old)[1], schema(new)[1]
    assert schema(old) == (old_head, old_head) and old_head != new_head

    # 1. The new release's `vbs db upgrade` first. While a controller runs it refuses, naming it...
    refused = new.vbs("db", "upgrade", "--config", str(new.config), check=False)
    assert refused.returncode == 1 and "controllers ran in the last minute" in refused.stderr, refused.stderr
    assert schema(new) == (old_head, new_head)
    # ...and with --force (this release's migrations only add tables and defaulted columns: CHANGELOG.md) it
    # runs ahead of the controllers: 0.1.0's, running, goes on serving on the newer schema.
    said = new.vbs("db", "upgrade", "--force", "--config", str(new.config)).stdout
    assert f"schema upgraded from {old_head} to {new_head}" in said, said
    assert schema(new) == (new_head, new_head)
    made_and_deleted(old)
    # A 0.1.0 controller that starts now refuses the schema it does not know (it checks as it starts): once
    # the database is upgraded, only the new release's controllers start.
    old.stop("controller")
    old.start("controller")
    wait_until(lambda: old.procs["controller"].poll() is not None, 120, 0.5, what="0.1.0's controller to refuse")
    assert old.procs["controller"].returncode != 0
    assert (f"has schema revision {new_head}, which this VBS does not know (its newest is {old_head}): it was "
            "upgraded by a newer VBS; run that version") in old.log("controller")
    old.procs.pop("controller")

    # 2. The new release's controller: 0.1.0's agents (no version headers) are served as release 0.1.0 on
    # wire version 1, and it makes and deletes a volume on 0.1.0's storage agent.
    new.start("controller")
    new.wait_up()
    first = (FIRST_RELEASE.version, UNVERSIONED_WIRE)
    assert first == (UNVERSIONED_RELEASE, 1)
    wait_until(lambda: versions_shown(new) == {"storage-1": first, "host-1": first}, 60, 0.5,
               what="the nodes' versions as 0.1.0's heartbeats carry them")
    made_and_deleted(new)

    # 3. The agents, one at a time: each reports this release once restarted, the other stays 0.1.0's.
    restart(new, "storage-agent")
    wait_until(lambda: versions_shown(new) == {"storage-1": (release, WIRE_VERSION), "host-1": first}, 120,
               0.5, what="storage-1 on the new release, host-1 still on 0.1.0")
    made_and_deleted(new)
    restart(new, "host-agent")
    wait_until(lambda: versions_shown(new) == {"storage-1": (release, WIRE_VERSION), "host-1": (release, WIRE_VERSION)},
               120, 0.5, what="both agents on the new release")
    made_and_deleted(new)

    # 4. Nothing half-served: the guest reads what it wrote under 0.1.0 through the new release's storage and
    # host agents, and writes on; the volume is detached by the new release, a snapshot of it and a volume from
    # that snapshot hold what the guest wrote, and it is deleted.
    (found,) = new.json("describe-volumes", kept)["volumes"]
    assert (found["status"], found["size_gib"], found["storage_node"]) == ("in-use", 1, "storage-1"), found
    assert read_in_guest(guest, kept) == pattern_sha256("old", MIB)
    write_in_guest(guest, kept, "new")
    assert read_in_guest(guest, kept) == pattern_sha256("new", MIB)
    new.vbs("detach-volume", kept, "--wait")
    wait_until(lambda: all(d.serial != virtio_serial(kept) for d in guest.disks()), 60, 1, what="the disk gone")
    snapshot = new.json("create-snapshot", kept, "--wait")["snapshot_id"]
    copy = new.json("create-volume", "--snapshot", snapshot, "--wait")["volume_id"]
    copy_file = new.dir / "pools" / "default" / "volumes" / f"{copy}.raw"
    with copy_file.open("rb") as f:
        assert hashlib.sha256(f.read(MIB << 20)).hexdigest() == pattern_sha256("new", MIB)
    for volume_id in (copy, kept):
        new.vbs("delete-volume", volume_id, "--wait")
    new.vbs("delete-snapshot", snapshot)
    assert not kept_file.exists() and not copy_file.exists()
    for role, proc in new.procs.items():
        assert proc.poll() is None, new.log(role)[-3000:]
        assert bytes(installed.vbs) in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")


def test_agents_of_the_new_release_serve_under_a_0_1_0_controller(first_release: Install,
                                                                   installed: Installed) -> None:
    """The reverse mix, as while a fleet's nodes are upgraded before its controllers (same wire version): the
    0.1.0 controller takes the new agents' heartbeats (it ignores the version headers it predates) and has
    the new storage agent make and delete a volume."""
    old, new = first_release, first_release.of(installed)
    kept = old.json("create-volume", "--size", "1", "--wait")["volume_id"]
    since, logged = datetime.now(UTC), {role: len(old.log(role)) for role in ("storage-agent", "host-agent")}
    restart(new, "storage-agent")
    restart(new, "host-agent")
    wait_until(lambda: heard_since(old, since), 120, 0.5, what="the new agents' heartbeats at 0.1.0's controller")
    old.wait_up()
    for role in ("storage-agent", "host-agent"):
        assert "heartbeat failed" not in old.log(role)[logged[role]:], old.log(role)[logged[role]:]
    made_and_deleted(old)
    (found,) = old.json("describe-volumes", kept)["volumes"]
    assert found["status"] == "available", found
    old.vbs("delete-volume", kept, "--wait")
    for role in ("storage-agent", "host-agent"):
        assert bytes(installed.vbs) in Path(f"/proc/{old.procs[role].pid}/cmdline").read_bytes().split(b"\0")
