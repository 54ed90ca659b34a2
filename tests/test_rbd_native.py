"""RBD volumes opened natively by the hypervisor, real parts only: a single-node Ceph, the controller,
a storage agent ``--backend rbd``, a host agent whose QEMU lists ``rbd`` among its protocols, and a
TCG guest that writes, reads and sees its disk grow.

No export daemon stands between the guest and Ceph: QEMU's rbd driver opens the image as the cephx
user of that one attachment. The isolation test proves what that user's caps mean on the real
cluster: its key reads and writes its own volume's image and gets EPERM on every other image.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import wait_until
from tests.rbd_cloud import RbdCloud, running_rbd_cloud
from tests.test_rbd_e2e import SPAN_MIB
from vbs.ids import virtio_serial
from vbs.rigs.testguest import pattern_sha256

pytestmark = pytest.mark.integration

GIB = 1 << 30
EPERM = 1


@pytest.fixture
def cloud(ceph: CephForTests, tmp_path: Path) -> Iterator[RbdCloud]:
    with running_rbd_cloud(ceph, ceph.new_pool(), tmp_path / "cloud", native=True) as c:
        yield c


def qemu_nodes(c: RbdCloud) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = c.guest.qmp("query-named-block-nodes", {"flat": True})
    return nodes


def disk_protocol_nodes(c: RbdCloud, volume_id: str) -> list[dict[str, Any]]:
    """The protocol nodes the host agent made for this volume's disk (their ids derive from its serial)."""
    serial = virtio_serial(volume_id)
    return [n for n in qemu_nodes(c) if serial in n["node-name"] and "proto" in n["node-name"]]


def agent_call(c: RbdCloud, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The storage agent's own API, as the controller calls it (the node's token)."""
    r = httpx.request(method, f"http://127.0.0.1:{c.svc.agent_port}/v1{path}", json=body, timeout=120,
                      headers={"authorization": f"Bearer {c.svc.agent_token}"})
    assert r.status_code == 200, r.text
    return r.json()


def native_connection(c: RbdCloud, volume_id: str, host: str = "host-1", read_only: bool = False) -> dict[str, Any]:
    """What the storage agent answers a host whose hypervisor opens RBD (the same as the attach got)."""
    body = {"host": {"name": host, "address": "127.0.0.1"}, "read_only": read_only, "protocols": ["rbd"]}
    conn: dict[str, Any] = agent_call(c, "PUT", f"/pools/default/volumes/{volume_id}/connections/{host}",
                                      body)["connection"]
    return conn


def mon_sessions(c: RbdCloud) -> set[str]:
    """The cephx entities connected to the (single) monitor now."""
    proc = subprocess.run(["ceph", "--conf", str(c.ceph.conf_path), "tell", "mon.a", "sessions", "--format", "json"],
                          capture_output=True, text=True, timeout=60, check=True)
    return {str(session.get("entity_name")) for session in json.loads(proc.stdout)}


def ceph_user_exists(c: RbdCloud, user: str) -> bool:
    proc = subprocess.run(["ceph", "--conf", str(c.ceph.conf_path), "auth", "get", f"client.{user}"],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode == 0


def as_user(c: RbdCloud, conn: dict[str, Any], key_file: Path, tool: str,
            *args: str) -> subprocess.CompletedProcess[str]:
    """``tool`` (rbd, rados) as the connection's cephx user, its key read from ``key_file``."""
    return subprocess.run(user_argv(conn, key_file, tool, *args), capture_output=True, text=True, timeout=120)


def user_argv(conn: dict[str, Any], key_file: Path, tool: str, *args: str) -> list[str]:
    """Only the monitors the connection names, no ceph.conf, no admin keyring."""
    return [tool, "--conf", "/dev/null", "--mon-host", ",".join(conn["monitors"]), "--id", conn["user"],
            "--keyfile", str(key_file), "--log-to-stderr=false", "--client-mount-timeout", "15", *args]


def qemu_io(conn: dict[str, Any], key_file: Path, *, read_only: bool) -> list[str]:
    """QEMU's own rbd driver (``qemu-io``, commands on stdin) as the connection's user, the key in a file."""
    host, _, port = conn["monitors"][0].rpartition(":")
    opts = (f"driver=rbd,pool={conn['pool']},image={conn['image']},user={conn['user']},key-secret=k,conf=/dev/null,"
            f"server.0.host={host},server.0.port={port}")
    return ["qemu-io", *(["-r"] if read_only else []), "--object", f"secret,id=k,format=base64,file={key_file}",
            "--image-opts", opts]


def key_file_of(conn: dict[str, Any], path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(conn["key"])
    return path


def image_id(c: RbdCloud, volume_id: str) -> str:
    return str(c.rbd("info", f"{c.pool}/{volume_id}")["id"])


def test_a_guest_writes_grows_snapshots_and_detaches_a_natively_opened_rbd_volume(cloud: RbdCloud) -> None:
    c, guest = cloud, cloud.guest
    vol = c.new_volume(size_gib=1)
    dev = c.attach(vol, "vdb")

    # QEMU opened the image itself, as the attachment's own cephx user; no export serves it.
    (proto,) = disk_protocol_nodes(c, vol)
    assert proto["drv"] == "rbd", proto
    opts = json.loads(proto["file"].removeprefix("json:"))
    user = f"vbs.host-1.{vol}"
    assert (opts["pool"], opts["image"], opts["user"]) == (c.pool, vol, user)
    assert not [n for n in qemu_nodes(c) if n["drv"] == "nbd"]
    exports = agent_call(c, "GET", "/exports")["exports"]
    assert [(e["key"], e["host"], e["protocol"]) for e in exports] == [(vol, "host-1", "rbd")]
    assert ceph_user_exists(c, user)

    assert guest.write_pattern(dev, "native", SPAN_MIB) == pattern_sha256("native", SPAN_MIB)
    assert guest.checksum(dev, SPAN_MIB) == pattern_sha256("native", SPAN_MIB)

    # Online resize: the image grows, QEMU's rbd node is told the new size, the guest sees it.
    r = c.vbs.http.post(f"/v1/volumes/{vol}/modify", json={"size_gib": 2})
    assert r.status_code == 200, r.text
    wait_until(lambda: int(guest.check(f"cat /sys/block/{dev}/size").strip()) * 512 == 2 * GIB, 180,
               what="the guest to see 2 GiB")
    wait_until(lambda: c.vbs.volume(vol)["size_gib"] == 2, 120, what="the modification recorded")
    assert c.rbd("info", f"{c.pool}/{vol}")["size"] == 2 * GIB
    assert [n["drv"] for n in disk_protocol_nodes(c, vol)] == ["rbd"]  # the same node, grown in place
    guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=1M seek=1500 count=1 conv=fsync 2>/dev/null", timeout=120)
    assert guest.checksum(dev, SPAN_MIB) == pattern_sha256("native", SPAN_MIB)

    # A snapshot of the attached volume, and a clone of it opened natively too: its user reads the
    # parent's data through read-only caps on the parent's objects.
    snap = c.snapshot(vol)
    clone = c.new_volume(snapshot_id=snap)
    clone_dev = c.attach(clone, "vdc")
    assert [n["drv"] for n in disk_protocol_nodes(c, clone)] == ["rbd"]
    assert guest.checksum(clone_dev, SPAN_MIB) == pattern_sha256("native", SPAN_MIB)
    guest.check(f"yes clone | head -c {SPAN_MIB << 20} | dd of=/dev/{clone_dev} bs=1M conv=fsync 2>/dev/null",
                timeout=180)  # copy-up: reads the parent, writes the clone
    assert guest.checksum(clone_dev, SPAN_MIB) == pattern_sha256("clone", SPAN_MIB)
    assert guest.checksum(dev, SPAN_MIB) == pattern_sha256("native", SPAN_MIB)
    c.assert_consistent()  # the attachments' cephx users count as their exports

    # Detach: the disk leaves the guest and the attachment's cephx user leaves Ceph.
    c.detach(clone)
    c.detach(vol)
    assert not ceph_user_exists(c, user) and not ceph_user_exists(c, f"vbs.host-1.{clone}")
    assert agent_call(c, "GET", "/exports")["exports"] == []
    assert not disk_protocol_nodes(c, vol) and not [o for o in guest.qmp("qom-list", {"path": "/objects"})
                                                     if vol.replace("-", "") in o["name"]]
    c.assert_consistent()


def test_the_key_of_one_volume_reaches_its_image_only(cloud: RbdCloud, tmp_path: Path) -> None:
    c = cloud
    a, b = c.new_volume(size_gib=1), c.new_volume(size_gib=1)
    dev = c.attach(a, "vdb")
    c.guest.check(f"yes isolation | head -c {SPAN_MIB << 20} | dd of=/dev/{dev} bs=1M conv=fsync 2>/dev/null",
                  timeout=180)
    conn = native_connection(c, a)  # the attachment's own connection, answered again (idempotent)
    assert conn["user"] == f"vbs.host-1.{a}" and conn["protocol"] == "rbd" and not conn["read_only"]
    key = key_file_of(conn, tmp_path / "a.key")
    b_id = image_id(c, b)

    # Its own image: read (the guest's pattern), write, lock.
    out = tmp_path / "a.img"
    done = as_user(c, conn, key, "rbd", "export", f"{c.pool}/{a}", str(out))
    assert done.returncode == 0, done.stderr
    with out.open("rb") as f:
        assert f.read(20) == b"isolation\nisolation\n"
    # (QEMU hands the image's exclusive lock over to the writer, as librbd clients do)
    done = as_user(c, conn, key, "rbd", "bench", "--io-type", "write", "--io-total", "4M", f"{c.pool}/{a}")
    assert done.returncode == 0, done.stderr

    # Another volume's image, its objects, the pool's listing: refused by the OSDs and the mon.
    for args in (("rbd", "export", f"{c.pool}/{b}", str(tmp_path / "b.img")),
                 ("rbd", "bench", "--io-type", "write", "--io-total", "4M", f"{c.pool}/{b}"),
                 ("rbd", "ls", c.pool),
                 ("rados", "-p", c.pool, "get", f"rbd_header.{b_id}", str(tmp_path / "b.header")),
                 ("rados", "-p", c.pool, "put", f"rbd_data.{b_id}.0000000000000000", str(key)),
                 ("rados", "-p", c.pool, "ls")):
        refused = as_user(c, conn, key, *args)
        assert refused.returncode != 0, args
        assert "Operation not permitted" in refused.stderr or "(1)" in refused.stderr, (args, refused.stderr)
    assert not (tmp_path / "b.img").exists() or (tmp_path / "b.img").stat().st_size == 0

    # A read-only connection: QEMU opens B with its key and reads, and cannot write.
    subprocess.run(["rbd", "--conf", str(c.ceph.conf_path), "bench", "--io-type", "write", "--io-total", "16M",
                    f"{c.pool}/{b}"], capture_output=True, timeout=120, check=True)  # data to read back
    ro = native_connection(c, b, host="host-2", read_only=True)
    ro_key = key_file_of(ro, tmp_path / "b-ro.key")
    done = subprocess.run(qemu_io(ro, ro_key, read_only=True), input="read 0 4096\nquit\n", capture_output=True,
                          text=True, timeout=120)
    assert "read 4096/4096 bytes at offset 0" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(qemu_io(ro, ro_key, read_only=False), input="write 0 4096\nquit\n", capture_output=True,
                          text=True, timeout=120)
    assert "write failed: Operation not permitted" in done.stdout + done.stderr, done.stdout + done.stderr
    refused = as_user(c, ro, ro_key, "rbd", "resize", "--allow-shrink", "--size", "512M", f"{c.pool}/{b}")
    assert refused.returncode != 0 and c.rbd("info", f"{c.pool}/{b}")["size"] == GIB

    # A client still connected when its connection goes (a forced detach of a host that did not
    # answer) is cut off: blocklisted, not left to use its tickets until they expire.
    output = tmp_path / "reader.out"
    with output.open("w") as out:
        reader = subprocess.Popen(qemu_io(ro, ro_key, read_only=True), stdin=subprocess.PIPE, stdout=out,
                                  stderr=subprocess.STDOUT, text=True)
    assert reader.stdin is not None
    try:
        reader.stdin.write("read 0 4096\n")
        reader.stdin.flush()
        wait_until(lambda: f"client.{ro['user']}" in mon_sessions(c), 60, what="the reader's session")
        agent_call(c, "DELETE", f"/pools/default/volumes/{b}/connections/host-2")
        reader.stdin.write("read 8388608 4096\nquit\n")  # another object: not in librbd's cache
        reader.stdin.close()
        reader.wait(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    text = output.read_text()
    assert "read 4096/4096 bytes at offset 0" in text and "read failed" in text, text
    assert "read 4096/4096 bytes at offset 8388608" not in text
    assert b"blocklisted" in (c.svc.tmp / "agent.log").read_bytes()
    agent_call(c, "DELETE", f"/pools/default/volumes/{b}/connections/host-2")  # idempotent
    assert not ceph_user_exists(c, ro["user"])
    refused = as_user(c, ro, ro_key, "rbd", "export", f"{c.pool}/{b}", str(tmp_path / "b-ro-2.img"))
    assert refused.returncode != 0  # the user is gone: its key opens nothing any more

    # The key is on no process's argv (QEMU and its children included) and in no agent's log.
    secret = conn["key"].encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert secret not in cmdline.read_bytes(), cmdline
        except OSError:
            continue  # a process that ended meanwhile
    assert c.guest.pid is not None and b"qemu-system" in Path(f"/proc/{c.guest.pid}/cmdline").read_bytes()
    for log in ("agent", "host-1", "controller"):
        text = (c.svc.tmp / f"{log}.log").read_bytes()
        assert text, log
        assert secret not in text and ro["key"].encode() not in text, log
    secrets_dir = c.svc.tmp / "vms-host-1" / ".vbs-secrets"
    assert not [f for f in secrets_dir.rglob("*") if f.is_file()]  # the key file lived only for object-add
    c.detach(a)
    assert not ceph_user_exists(c, conn["user"])
