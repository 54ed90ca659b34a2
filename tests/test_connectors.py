"""Host connectors: a connection turned into what QEMU needs, and secrets that never leak (unit tier).

No VM: the QEMU forms are checked as data here; test_qemu_hypervisor.py opens them in real VMs.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from pydantic import SecretStr

from vbs.connectors import CONNECTORS, QemuIds, connector_for
from vbs.connectors.nbd import NBD_RECONNECT_DELAY_S
from vbs.errors import InvalidParameter
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.host.hypervisors.qemu_ids import copy_ids, disk_ids
from vbs.ids import virtio_serial
from vbs.wire.connection import FileConnection, IscsiConnection, NbdConnection, RbdConnection

pytestmark = pytest.mark.unit

PSK_KEY = "0123456789abcdef0123456789abcdef"
CHAP_SECRET = "chap-secret-1"
SNAP = "snap-0123456789abcdef0"


def vol(n: int) -> str:
    return f"vol-{n:017x}"


IDS = QemuIds(proto="vbs-x-proto", secret="vbs-x-sec", tls="vbs-x-tls")
CEPHX_KEY = "AQBhmCNpAAAAABAAxm1mM9A7dYyDCYMxQk2x1w=="
RBD = RbdConnection(monitors=["127.0.0.1:3300", "[::1]:3301"], pool="rbd", image=vol(1),
                    user=f"vbs.host-1.{vol(1)}", key=SecretStr(CEPHX_KEY))


def test_connectors_are_found_by_the_connections_protocol() -> None:
    assert sorted(CONNECTORS) == ["file", "iscsi", "nbd", "rbd"]
    for conn in (NbdConnection(host="10.0.0.1", port=10809, export="v"),
                 IscsiConnection(host="10.0.0.1", port=3260, iqn="iqn.2024-01.org.vbs:v"),
                 RBD, FileConnection(path="/srv/v.raw")):  # fmt: skip
        assert connector_for(conn).protocol == conn.protocol
    assert QemuDriver.capabilities.protocols == ["file", "iscsi", "nbd", "rbd"]
    assert QemuDriver.capabilities.point_in_time_copy and QemuDriver.capabilities.online_resize
    with pytest.raises(InvalidParameter, match="31"):
        QemuIds(proto="x" * 32, secret="s", tls="t")


def test_nbd_connector_gives_a_reconnecting_node_and_knows_it_by_url_or_json() -> None:
    conn = NbdConnection(host="127.0.0.1", port=10809, export="vol-1")
    nbd = connector_for(conn)
    blockdev = nbd.qemu_blockdev(conn, IDS)
    assert blockdev.objects == ()
    assert blockdev.options == {"driver": "nbd", "server": {"type": "inet", "host": "127.0.0.1", "port": "10809"},
                                "export": "vol-1", "reconnect-delay": NBD_RECONNECT_DELAY_S}
    assert nbd.qemu_node_opens({"drv": "nbd", "file": "nbd://127.0.0.1:10809/vol-1"}, conn)
    assert not nbd.qemu_node_opens({"drv": "nbd", "file": "nbd://127.0.0.1:10810/vol-1"}, conn)
    assert not nbd.qemu_node_opens({"drv": "file", "file": "nbd://127.0.0.1:10809/vol-1"}, conn)
    v6 = NbdConnection(host="::1", port=10809, export="vol-1")
    assert nbd.qemu_node_opens({"drv": "nbd", "file": "nbd://[::1]:10809/vol-1"}, v6)
    as_json = {"driver": "nbd", "export": "vol-1", "server": {"type": "inet", "host": "::1", "port": "10809"}}
    assert nbd.qemu_node_opens({"drv": "nbd", "file": "json:" + json.dumps(as_json)}, v6)
    assert not nbd.qemu_node_opens({"drv": "nbd", "file": "json:" + json.dumps(as_json)}, conn)
    assert not nbd.qemu_node_opens({"drv": "nbd", "file": "json:{not json"}, conn)
    assert not nbd.qemu_node_sees_growth  # an open NBD node keeps the size its export had


def test_nbd_tls_psk_key_exists_only_while_its_object_is_made(tmp_path: Path) -> None:
    conn = NbdConnection(host="127.0.0.1", port=10809, export="v", tls_psk_identity="host1",
                         tls_psk_key=SecretStr(PSK_KEY))
    blockdev = connector_for(conn).qemu_blockdev(conn, IDS)
    assert blockdev.options["tls-creds"] == IDS.tls
    (creds,) = blockdev.objects
    assert (creds.qom_type, creds.id, dict(creds.props)) == ("tls-creds-psk", IDS.tls,
                                                             {"endpoint": "client", "username": "host1"})
    assert PSK_KEY not in repr(blockdev) and PSK_KEY not in str(blockdev)
    secrets = tmp_path / "secrets"
    with creds.qmp_arguments(secrets) as args:
        key_dir = Path(args["dir"])
        assert args == {"qom-type": "tls-creds-psk", "id": IDS.tls, "endpoint": "client", "username": "host1",
                        "dir": str(key_dir)}
        assert (key_dir / "keys.psk").read_text() == f"host1:{PSK_KEY}\n"
        assert stat.S_IMODE((key_dir / "keys.psk").stat().st_mode) == 0o600
        assert stat.S_IMODE(key_dir.stat().st_mode) == stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert list(secrets.iterdir()) == []
    no_identity = conn.model_copy(update={"tls_psk_identity": None})
    assert connector_for(conn).qemu_blockdev(no_identity, IDS).objects[0].props["username"] == "qemu"
    bad = conn.model_copy(update={"tls_psk_key": SecretStr("not-hex-" + PSK_KEY)})
    with pytest.raises(InvalidParameter, match="hexadecimal") as raised:
        connector_for(bad).qemu_blockdev(bad, IDS)
    assert PSK_KEY not in str(raised.value)


def test_nbd_connector_opens_a_unix_socket_and_knows_it_by_url_or_json() -> None:
    conn = NbdConnection(socket="/srv/vbs/nbd/nbd.sock", export="vol-1")
    nbd = connector_for(conn)
    blockdev = nbd.qemu_blockdev(conn, IDS)
    assert blockdev.objects == ()
    assert blockdev.options["server"] == {"type": "unix", "path": "/srv/vbs/nbd/nbd.sock"}
    assert nbd.qemu_node_opens({"drv": "nbd", "file": "nbd+unix:///vol-1?socket=/srv/vbs/nbd/nbd.sock"}, conn)
    assert not nbd.qemu_node_opens({"drv": "nbd", "file": "nbd+unix:///vol-1?socket=/other/nbd.sock"}, conn)
    as_json = {"driver": "nbd", "export": "vol-1", "server": {"type": "unix", "path": "/srv/vbs/nbd/nbd.sock"}}
    assert nbd.qemu_node_opens({"drv": "nbd", "file": "json:" + json.dumps(as_json)}, conn)
    tcp = NbdConnection(host="127.0.0.1", port=10809, export="vol-1")
    assert not nbd.qemu_node_opens({"drv": "nbd", "file": "json:" + json.dumps(as_json)}, tcp)


def test_nbd_x509_presents_the_hosts_own_certificate_directory(tmp_path: Path) -> None:
    conn = NbdConnection(host="10.0.0.5", port=10809, export="v", tls="x509")
    blockdev = connector_for(conn).qemu_blockdev(conn, IDS)
    assert blockdev.options["tls-creds"] == IDS.tls
    (creds,) = blockdev.objects
    assert (creds.qom_type, dict(creds.props)) == ("tls-creds-x509", {"endpoint": "client", "verify-peer": True})
    with creds.qmp_arguments(tmp_path / "secrets", tmp_path / "x509") as args:
        assert args["dir"] == str(tmp_path / "x509")
    with pytest.raises(InvalidParameter, match="tls_cert"), creds.qmp_arguments(tmp_path / "secrets"):
        pass  # a host agent without a certificate cannot open an X.509 export


def test_iscsi_connector_passes_the_chap_secret_only_as_a_secret_object(tmp_path: Path) -> None:
    conn = IscsiConnection(host="127.0.0.1", port=3260, iqn="iqn.2024-01.org.vbs:v1", lun=1, chap_user="u1",
                           chap_secret=SecretStr(CHAP_SECRET), initiator_name="iqn.2024-01.org.vbs:host1")
    iscsi = connector_for(conn)
    blockdev = iscsi.qemu_blockdev(conn, IDS)
    assert blockdev.options == {"driver": "iscsi", "transport": "tcp", "portal": "127.0.0.1:3260",
                                "target": "iqn.2024-01.org.vbs:v1", "lun": 1,
                                "initiator-name": "iqn.2024-01.org.vbs:host1", "user": "u1",
                                "password-secret": IDS.secret}
    (secret,) = blockdev.objects
    assert CHAP_SECRET not in repr(blockdev) and CHAP_SECRET not in json.dumps(blockdev.options)
    with secret.qmp_arguments(tmp_path) as args:
        assert args == {"qom-type": "secret", "id": IDS.secret, "data": CHAP_SECRET}
    assert list(tmp_path.iterdir()) == []  # nothing written for a secret object

    reported = {"drv": "iscsi", "file": "json:" + json.dumps({**blockdev.options, "lun": "1"})}
    assert iscsi.qemu_node_opens(reported, conn)
    assert not iscsi.qemu_node_opens(reported, conn.model_copy(update={"lun": 2}))
    assert not iscsi.qemu_node_opens(reported, conn.model_copy(update={"chap_user": "u2"}))
    assert not iscsi.qemu_node_opens({"drv": "iscsi", "file": "iscsi://127.0.0.1:3260/x/1"}, conn)

    plain = IscsiConnection(host="::1", port=3260, iqn="iqn.2024-01.org.vbs:v1")
    plain_dev = iscsi.qemu_blockdev(plain, IDS)
    assert plain_dev.objects == () and plain_dev.options["portal"] == "[::1]:3260" and "user" not in plain_dev.options
    with pytest.raises(InvalidParameter, match="without a secret"):
        iscsi.qemu_blockdev(conn.model_copy(update={"chap_secret": None}), IDS)


def test_file_connector_opens_the_path_and_sees_it_grow() -> None:
    conn = FileConnection(path="/srv/pool/v.raw")
    file = connector_for(conn)
    assert file.qemu_blockdev(conn, IDS).options == {"driver": "file", "filename": "/srv/pool/v.raw"}
    assert file.qemu_blockdev(conn, IDS).objects == ()
    assert file.qemu_node_opens({"drv": "file", "file": "/srv/pool/v.raw"}, conn)
    assert not file.qemu_node_opens({"drv": "file", "file": "/srv/pool/w.raw"}, conn)
    assert file.qemu_node_sees_growth


def test_disk_and_copy_ids_fit_qemu_and_stay_apart() -> None:
    ids = disk_ids(virtio_serial(vol(0x80)))
    first, second = ids.generations
    assert (first.proto, first.secret, first.tls) == (ids.proto, ids.secret, ids.tls)  # what attach uses
    assert len({first.proto, second.proto, first.secret, second.secret, first.tls, second.tls}) == 6
    assert max(len(n) for n in ids.nodes_top_down) <= 31  # QEMU's limit on node names
    assert {first.proto, second.proto} <= set(ids.nodes_top_down)
    assert set(first.objects + second.objects) <= set(ids.objects)
    cids = copy_ids(virtio_serial(vol(0x80)), SNAP)
    assert max(len(cids.filter), len(cids.target.proto)) <= 31
    assert cids.job.startswith(ids.copy_job_prefix)
    assert not {cids.filter, cids.target.proto, *cids.target.objects} & {*ids.nodes_top_down, *ids.objects}
    for bad in ("snap-with-many-dashes", "x" * 30, "", "snap_0"):
        with pytest.raises(InvalidParameter):
            copy_ids(virtio_serial(vol(0x80)), bad)
    with pytest.raises(InvalidParameter):
        disk_ids("vol-with-dash")




def test_rbd_connector_gives_the_key_to_qemu_in_a_file_that_exists_only_while_its_secret_is_made(
        tmp_path: Path) -> None:
    rbd = connector_for(RBD)
    blockdev = rbd.qemu_blockdev(RBD, IDS)
    assert blockdev.options == {
        "driver": "rbd", "pool": "rbd", "image": vol(1), "user": f"vbs.host-1.{vol(1)}",
        "server": [{"host": "127.0.0.1", "port": "3300"}, {"host": "::1", "port": "3301"}],
        "key-secret": IDS.secret, "auth-client-required": ["cephx"]}
    (secret,) = blockdev.objects
    assert (secret.qom_type, secret.id, dict(secret.props)) == ("secret", IDS.secret, {"format": "base64"})
    assert CEPHX_KEY not in repr(blockdev) and CEPHX_KEY not in str(blockdev) and CEPHX_KEY not in repr(RBD)
    secrets = tmp_path / "secrets"
    with secret.qmp_arguments(secrets) as args:
        key_file = Path(args["file"])
        assert args == {"qom-type": "secret", "id": IDS.secret, "format": "base64", "file": str(key_file)}
        assert CEPHX_KEY not in json.dumps(args)  # what a QMP log line could show
        assert key_file.read_text() == CEPHX_KEY
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
        assert key_file.parent.parent == secrets
    assert not key_file.exists() and not key_file.parent.exists()
    assert list(secrets.iterdir()) == []
    in_namespace = RBD.model_copy(update={"namespace": "tenant-1"})
    assert rbd.qemu_blockdev(in_namespace, IDS).options["namespace"] == "tenant-1"


def test_rbd_connector_knows_its_node_and_grows_it_in_place() -> None:
    rbd = connector_for(RBD)
    # As QEMU 7.2 names an rbd node (measured): its options as json, the servers flattened.
    named = {"driver": "rbd", "pool": "rbd", "image": vol(1), "server.0.host": "127.0.0.1",
             "server.0.port": "3300", "user": f"vbs.host-1.{vol(1)}"}
    assert rbd.qemu_node_opens({"drv": "rbd", "file": "json:" + json.dumps(named)}, RBD)
    assert not rbd.qemu_node_opens({"drv": "rbd", "file": "json:" + json.dumps({**named, "image": vol(2)})}, RBD)
    assert not rbd.qemu_node_opens({"drv": "rbd", "file": "json:" + json.dumps({**named, "user": "admin"})}, RBD)
    assert not rbd.qemu_node_opens({"drv": "nbd", "file": "json:" + json.dumps(named)}, RBD)
    assert rbd.qemu_node_sees_growth  # block_resize to the image's new size shows it to the guest


def test_the_qemu_driver_lists_only_the_protocols_its_operator_names(tmp_path: Path) -> None:
    # A QEMU without the rbd block driver (Debian's qemu-block-extra) must not be sent RBD images.
    driver = QemuDriver(tmp_path, protocols=["nbd", "iscsi"])
    assert driver.capabilities.protocols == ["iscsi", "nbd"] and driver.capabilities.online_resize
    assert QemuDriver(tmp_path).capabilities.protocols == ["file", "iscsi", "nbd", "rbd"]
    for bad in (["nbd", "ceph"], []):
        with pytest.raises(InvalidParameter, match="protocols"):
            QemuDriver(tmp_path, protocols=bad)
