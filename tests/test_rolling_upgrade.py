"""A rolling upgrade from the previous release to this tree, both real installs.

The first release, 0.1.0, is built from its commit in this repository's history (tests/installed.py
``FIRST_RELEASE``; the test fails, saying what to fetch, where the history lacks it) and this tree's wheel
as tests/test_install.py builds it, each installed into its own venv of Debian's python3. One install
(tests/installed_cluster.py: its services started by their units' ``ExecStart``, mutual TLS from its CA, on
loopback, its metadata on a real PostgreSQL) then goes from 0.1.0 to this release as docs/install.md
("Upgrades") orders it: ``vbs db upgrade`` of the new release ahead of the controllers (refused while they
run unless ``--force``, for a release whose migrations only add), the controller, then the storage agent
and the host agent one at a time, with a volume made under 0.1.0 kept and used throughout. The reverse
mix, agents of this release under a 0.1.0 controller, runs too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.installed import FIRST_RELEASE, ROLES, Installed
from tests.installed_cluster import Install, new_install
from tests.postgres_cluster import PostgresForTests
from vbs.versions import UNVERSIONED_RELEASE, UNVERSIONED_WIRE, WIRE_VERSION

pytestmark = pytest.mark.integration

PATTERN = b"written under VBS 0.1.0\n" * 100


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


def test_a_rolling_upgrade_from_0_1_0_keeps_every_volume_served(first_release: Install, installed: Installed) -> None:
    old, new = first_release, first_release.of(installed)
    release = installed.version
    # Under 0.1.0: a volume that holds data (written into its file, as a guest would have) before the upgrade.
    kept = old.json("create-volume", "--size", "1", "--wait")["volume_id"]
    kept_file = old.dir / "pools" / "default" / "volumes" / f"{kept}.raw"
    with kept_file.open("r+b") as f:
        f.write(PATTERN)
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

    # 4. Nothing half-served: the volume made under 0.1.0 is as it was, and the new release's services use it
    # whole — a snapshot of it and a volume from that snapshot hold what it held; then it is deleted.
    (found,) = new.json("describe-volumes", kept)["volumes"]
    assert (found["status"], found["size_gib"], found["storage_node"]) == ("available", 1, "storage-1"), found
    snapshot = new.json("create-snapshot", kept, "--wait")["snapshot_id"]
    copy = new.json("create-volume", "--snapshot", snapshot, "--wait")["volume_id"]
    copy_file = new.dir / "pools" / "default" / "volumes" / f"{copy}.raw"
    with copy_file.open("rb") as f:
        assert f.read(len(PATTERN)) == PATTERN
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
