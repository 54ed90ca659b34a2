"""Native RBD connections as data (unit tier): the wire model's checks, the cephx user and caps of
one attachment, and the controller's refusal of monitors a storage node did not report.

The real cluster proves the caps in tests/test_rbd_native.py (a key of one volume cannot read another).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from vbs.controller.fleet.agents import StorageAgent
from vbs.errors import DriverError, InvalidParameter
from vbs.storage.backends import rbd_access
from vbs.storage.backends.rbd_access import ImageRef
from vbs.wire.connection import MAX_MONITORS, RbdConnection
from vbs.wire.storage import ConnectionAnswer, ConnectionRequest, PoolInfo

pytestmark = pytest.mark.unit

KEY = "AQBhmCNpAAAAABAAxm1mM9A7dYyDCYMxQk2x1w=="
VOL = "vol-0123456789abcdef0"


def conn(**changes: Any) -> dict[str, Any]:
    return {"protocol": "rbd", "monitors": ["127.0.0.1:3300"], "pool": "rbd", "image": VOL,
            "user": f"vbs.host-1.{VOL}", "key": KEY, **changes}


def test_an_rbd_connection_crosses_the_wire_with_its_key_revealed_only_in_json() -> None:
    answer = ConnectionAnswer.model_validate({"connection": conn(monitors=["10.0.0.1:6789", "[fd00::1]:3300",
                                                                           "mon-a.example.org:3300"])})
    c = answer.connection
    assert isinstance(c, RbdConnection) and c.key.get_secret_value() == KEY and not c.read_only
    assert KEY not in repr(answer) and KEY not in str(answer.model_dump())
    assert answer.model_dump(mode="json")["connection"]["key"] == KEY
    assert ConnectionAnswer.model_validate_json(answer.model_dump_json()) == answer


@pytest.mark.parametrize("bad", [
    {"monitors": []},
    {"monitors": [f"10.0.0.{i}:3300" for i in range(MAX_MONITORS + 1)]},
    {"monitors": ["10.0.0.1"]},                       # no port
    {"monitors": ["10.0.0.1:0"]},
    {"monitors": ["10.0.0.1:70000"]},
    {"monitors": ["10.0.0.1:3300;10.0.0.2:3300"]},    # what Ceph's mon_host would split on
    {"monitors": ["fd00::1:3300"]},                   # IPv6 without brackets
    {"monitors": ["10.0.0.1:3300", "10.0.0.1:3300"]},
    {"monitors": ["-x:3300"]},
    {"pool": "a/b"}, {"pool": ""}, {"namespace": "n s"},
    {"image": "vol-1"}, {"image": "../etc"},
    {"user": "client admin"}, {"user": ""},
    {"key": "not a key!"}, {"key": ""},
    {"protocol": "ceph"},
    {"extra": 1},
])
def test_an_rbd_connection_refuses_what_a_host_should_not_open(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as err:
        ConnectionAnswer.model_validate({"connection": conn(**bad)})
    assert KEY not in str(err.value)


def test_a_refused_key_is_not_repeated_in_the_error() -> None:
    secret_ish = "AQB" + "x" * 200  # too long to be a key, but perhaps one pasted twice
    with pytest.raises(ValidationError) as err:
        RbdConnection.model_validate(conn(key=secret_ish))
    assert secret_ish not in str(err.value) and "xxxxxxxx" not in str(err.value)


def test_a_connection_request_of_an_older_controller_asks_for_no_native_protocol() -> None:
    host = {"name": "host-1", "address": "127.0.0.1"}
    assert ConnectionRequest.model_validate({"host": host}).protocols == []
    assert ConnectionRequest.model_validate({"host": host, "protocols": ["rbd", "nbd"]}).protocols == ["rbd", "nbd"]
    with pytest.raises(ValidationError):
        ConnectionRequest.model_validate({"host": host, "protocols": ["ceph"]})
    pool = {"name": "p", "backend": "file", "capacity_bytes": 1, "free_bytes": 1, "clone_method": "reflink",
            "point_in_time": True}
    assert PoolInfo.model_validate(pool).monitors == []
    # Left out while empty: agents and controllers older than these fields refuse unknown ones.
    assert "protocols" not in ConnectionRequest.model_validate({"host": host}).model_dump(mode="json")
    assert "monitors" not in PoolInfo.model_validate(pool).model_dump(mode="json")
    rbd_pool = PoolInfo.model_validate({**pool, "monitors": ["10.0.0.1:3300"]})
    assert PoolInfo.model_validate_json(rbd_pool.model_dump_json()) == rbd_pool
    with pytest.raises(ValidationError):
        PoolInfo.model_validate({**pool, "monitors": ["10.0.0.1:3300,10.0.0.2:3300"]})


def test_the_attachment_user_is_one_per_host_and_volume_and_refuses_odd_names() -> None:
    assert rbd_access.attachment_user("host-1", VOL) == f"vbs.host-1.{VOL}"
    for host, volume in (("Host 1", VOL), ("host-1", "vol-1"), ("", VOL), ("h;x", VOL)):
        with pytest.raises(InvalidParameter):
            rbd_access.attachment_user(host, volume)


def test_caps_name_the_images_objects_and_only_read_its_parents() -> None:
    image = ImageRef("rbd", "", "10aa", parent=("rbd", "", "10bb"))
    parent = ImageRef("rbd", "", "10bb", parent=("base", "", "10cc"))
    grandparent = ImageRef("base", "", "10cc")
    assert rbd_access.osd_caps(VOL, [ImageRef("rbd", "", "10aa")], read_only=False).split(", ") == [
        f"allow rwx pool=rbd object_prefix rbd_id.{VOL}",
        "allow rwx pool=rbd object_prefix rbd_header.10aa",
        "allow rwx pool=rbd object_prefix rbd_object_map.10aa",
        "allow rwx pool=rbd object_prefix rbd_data.10aa.",
        "allow rx pool=rbd object_prefix rbd_info",
    ]
    caps = rbd_access.osd_caps(VOL, [image, parent, grandparent], read_only=False).split(", ")
    assert "allow rx pool=rbd object_prefix rbd_data.10bb." in caps
    assert "allow rx pool=base object_prefix rbd_header.10cc" in caps
    assert "allow rx pool=base object_prefix rbd_directory" in caps  # a parent is opened by id
    assert not [c for c in caps if "rwx" in c and ("10bb" in c or "10cc" in c or "rbd_directory" in c)]
    read_only = rbd_access.osd_caps(VOL, [image, parent], read_only=True).split(", ")
    assert [c for c in read_only if "rwx" in c] == ["allow rwx pool=rbd object_prefix rbd_header.10aa"]
    assert "allow rx pool=rbd object_prefix rbd_data.10aa." in read_only
    in_namespace = rbd_access.osd_caps(VOL, [ImageRef("rbd", "t1", "10aa")], read_only=False)
    assert "allow rwx pool=rbd namespace=t1 object_prefix rbd_data.10aa." in in_namespace
    with pytest.raises(DriverError):
        ImageRef("rbd", "", "10aa, allow rwx")  # what rbd info said is checked before it names caps


def test_what_ceph_answers_is_read_without_repeating_keys() -> None:
    info = {"name": VOL, "id": "1068bd4559c1", "size": 1 << 30,
            "parent": {"pool": "p1", "pool_namespace": "", "image": "vol-x", "id": "102a6dd4e741",
                       "snapshot": "s1", "trash": False, "overlap": 1 << 30}}
    assert rbd_access.parse_image_ref(json.dumps(info), "p1") == ImageRef("p1", "", "1068bd4559c1",
                                                                          ("p1", "", "102a6dd4e741"))
    dump = {"mons": [{"name": "a", "public_addrs": {"addrvec": [
        {"type": "v2", "addr": "127.0.0.1:44869", "nonce": 0}, {"type": "v1", "addr": "127.0.0.1:39625"}]}},
        {"name": "b", "public_addrs": {"addrvec": [{"type": "v1", "addr": "127.0.0.2:6789"}]}}]}
    assert rbd_access.parse_monitors(json.dumps(dump)) == ["127.0.0.1:44869", "127.0.0.2:6789"]
    with pytest.raises(DriverError):
        rbd_access.parse_monitors(json.dumps({"mons": []}))
    auth = [{"entity": f"client.vbs.host-1.{VOL}", "key": KEY, "caps": {"mon": "profile rbd", "osd": "allow r"}}]
    assert rbd_access.parse_key(json.dumps(auth), f"vbs.host-1.{VOL}") == KEY
    assert rbd_access.parse_caps(json.dumps(auth), f"vbs.host-1.{VOL}")["osd"] == "allow r"
    with pytest.raises(DriverError) as err:
        rbd_access.parse_key("key = " + KEY, "x")
    assert KEY not in str(err.value)
    osd = rbd_access.osd_caps(VOL, [ImageRef("p1", "", "10aa")], read_only=False)
    listing = {"auth_dump": [
        {"entity": f"client.vbs.host-1.{VOL}", "key": KEY, "caps": {"mon": "profile rbd", "osd": osd}},
        {"entity": f"client.vbs.host-2.{VOL}", "key": KEY, "caps": {"osd": osd.replace("pool=p1", "pool=p2")}},
        {"entity": "client.admin", "key": KEY, "caps": {"osd": "allow *"}},
        {"entity": "client.vbs.odd", "key": KEY, "caps": {"osd": osd}},
    ]}
    found = rbd_access.parse_attachment_users(json.dumps(listing), "p1")
    assert [(g.key, g.host, g.protocol) for g in found] == [(VOL, "host-1", "rbd")]
    assert KEY not in repr(found)


def test_the_controller_refuses_monitors_the_storage_node_did_not_report() -> None:
    agent = StorageAgent(None, "storage-1", frozenset({"10.0.0.5"}), frozenset({"10.0.0.1:3300"}))  # type: ignore[arg-type]
    good = RbdConnection.model_validate(conn(monitors=["10.0.0.1:3300"], key=SecretStr(KEY)))
    assert agent._vouched(good) is good
    with pytest.raises(DriverError, match="10.0.0.9:3300"):
        agent._vouched(RbdConnection.model_validate(conn(monitors=["10.0.0.1:3300", "10.0.0.9:3300"])))
    with pytest.raises(DriverError):
        StorageAgent(None, "s", frozenset({"10.0.0.5"}))._vouched(good)  # type: ignore[arg-type]


def test_the_sessions_of_a_removed_user_are_found_for_blocklisting() -> None:
    entity = f"client.vbs.host-1.{VOL}"
    sessions = [  # as Ceph 16's "ceph tell mon.a sessions --format json" answers (abridged)
        {"name": "osd.0", "entity_name": "osd.0", "addrs": {"addrvec": [{"type": "v2", "addr": "127.0.0.1:6830",
                                                                          "nonce": 30033}]}},
        {"name": "client.?", "entity_name": entity, "addrs": {"addrvec": [{"type": "any", "addr": "127.0.0.1:0",
                                                                           "nonce": 1977626476}]}},
        {"name": "client.4161", "entity_name": entity, "addrs": {"addrvec": [
            {"type": "any", "addr": "[fd00::2]:0", "nonce": 7}, {"type": "any", "addr": "1.2.3.4:0 x", "nonce": 1}]}},
        {"name": "client.4162", "entity_name": "client.admin", "addrs": {"addrvec": [
            {"type": "any", "addr": "127.0.0.1:0", "nonce": 5}]}},
    ]
    assert rbd_access.parse_sessions(json.dumps(sessions), entity) == ["127.0.0.1:0/1977626476", "[fd00::2]:0/7"]
    assert rbd_access.parse_sessions("[]", entity) == []
    dump = {"mons": [{"name": "a"}, {"name": "b c"}, {"name": "mon-2"}]}
    assert rbd_access.parse_mon_names(json.dumps(dump)) == ["a", "mon-2"]
