"""EC2 Query parameters: botocore's own ``ec2`` serializer round-trips through parse_form + QueryParams exactly.

Error cases answer 400 with EC2-like codes; fuzzing proves no body can make a getter raise anything else or run long.
"""

from __future__ import annotations

import time
from typing import Any

import botocore.session
import pytest
from botocore.awsrequest import AWSRequest
from botocore.serialize import create_serializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vbs.controller.ec2.query import MAX_BODY, MAX_INDEX, MAX_PARAMS, QueryParams, parse_form
from vbs.errors import InvalidParameter, MissingParameter, VbsError

pytestmark = pytest.mark.unit

_MODEL = botocore.session.get_session().get_service_model("ec2")
_SERIALIZER = create_serializer("ec2")


def wire_body(operation: str, params: dict[str, Any]) -> bytes:
    """The exact body botocore puts on the wire for ``operation``: its serializer, then AWSRequest's encoding."""
    serialized = _SERIALIZER.serialize_to_request(params, _MODEL.operation_model(operation))
    prepared = AWSRequest(method="POST", url="http://127.0.0.1:8770/", data=serialized["body"],
                          headers=serialized["headers"]).prepare()
    body = prepared.body
    return body.encode() if isinstance(body, str) else body


def roundtrip(operation: str, params: dict[str, Any]) -> QueryParams:
    q = QueryParams(parse_form(wire_body(operation, params)))
    assert q.action == operation
    assert q.version == "2016-11-15"
    return q


# --- botocore round trips --------------------------------------------------------------------------------------


def test_create_volume_with_tag_specifications() -> None:
    tags = [{"Key": "Name", "Value": "db data"}, {"Key": "team/é", "Value": "a&b=c+d%20"},
            {"Key": "empty", "Value": ""}]
    q = roundtrip("CreateVolume", {
        "AvailabilityZone": "vbs-az1", "Size": 100, "VolumeType": "gp3", "Iops": 3000, "Throughput": 125,
        "Encrypted": True, "MultiAttachEnabled": False, "SnapshotId": "snap-0123456789abcdef0",
        "ClientToken": "token-1", "DryRun": True,
        "TagSpecifications": [{"ResourceType": "volume", "Tags": tags}, {"Tags": [{"Key": "k", "Value": "v"}]}],
    })
    assert q.str("AvailabilityZone", required=True) == "vbs-az1"
    assert q.int("Size", min=1, max=16384) == 100
    assert q.str("VolumeType") == "gp3"
    assert q.int("Iops") == 3000 and q.int("Throughput") == 125
    assert q.bool("Encrypted") is True and q.bool("MultiAttachEnabled", default=True) is False
    assert q.str("SnapshotId") == "snap-0123456789abcdef0" and q.str("ClientToken") == "token-1"
    assert q.bool("DryRun") is True
    assert q.str("KmsKeyId") is None and q.int("Iops2") is None
    assert q.tag_specifications() == [("volume", {t["Key"]: t["Value"] for t in tags}), (None, {"k": "v"})]
    known = {"AvailabilityZone", "Size", "VolumeType", "Iops", "Throughput", "Encrypted", "MultiAttachEnabled",
             "SnapshotId", "ClientToken", "DryRun", "TagSpecification"}
    assert q.unknown(known) == []
    assert q.unknown(known - {"Iops", "TagSpecification"}) == ["Iops", "TagSpecification"]


def test_describe_volumes_with_ids_filters_and_paging() -> None:
    ids = [f"vol-{i:017x}" for i in range(1, 13)]  # 12 ids: order must be numeric (… 9, 10, 11), not textual
    filters = [{"Name": "status", "Values": ["available", "in-use"]},
               {"Name": "tag:Name", "Values": ["a b", "c,d", "é"]},
               {"Name": "attachment.instance-id", "Values": ["i-1"]}]
    q = roundtrip("DescribeVolumes", {"VolumeIds": ids, "Filters": filters, "MaxResults": 5, "NextToken": "tok=="})
    assert q.list("VolumeId") == ids
    assert q.filters() == {f["Name"]: f["Values"] for f in filters}
    assert q.int("MaxResults", min=5, max=1000) == 5
    assert q.str("NextToken") == "tok=="
    assert q.unknown({"VolumeId", "Filter", "MaxResults", "NextToken"}) == []


def test_describe_volumes_without_anything() -> None:
    q = roundtrip("DescribeVolumes", {"VolumeIds": [], "Filters": []})
    assert q.list("VolumeId") == [] and q.filters() == {} and q.int("MaxResults") is None
    assert q.bool("DryRun") is False


def test_create_tags() -> None:
    q = roundtrip("CreateTags", {"Resources": ["vol-1", "snap-2"],
                                 "Tags": [{"Key": "a", "Value": "1"}, {"Key": "b", "Value": ""}, {"Key": "c"}]})
    assert q.list("ResourceId") == ["vol-1", "snap-2"]
    assert q.tags() == {"a": "1", "b": "", "c": ""}


def test_delete_tags_keeps_absent_and_empty_values_apart() -> None:
    tags = [{"Key": "any"}, {"Key": "exact", "Value": "v"}, {"Key": "blank", "Value": ""}]
    q = roundtrip("DeleteTags", {"Resources": ["vol-1"], "Tags": tags})
    assert q.list("ResourceId") == ["vol-1"]
    assert q.tag_keys() == [("any", None), ("exact", "v"), ("blank", "")]
    assert roundtrip("DeleteTags", {"Resources": ["vol-1"]}).tag_keys() == []


def test_describe_snapshots() -> None:
    q = roundtrip("DescribeSnapshots", {
        "SnapshotIds": ["snap-1", "snap-2"], "OwnerIds": ["self", "123456789012"], "RestorableByUserIds": ["all"],
        "Filters": [{"Name": "volume-id", "Values": ["vol-1"]}, {"Name": "tag-key", "Values": ["x", "y"]}],
        "MaxResults": 10, "NextToken": "n", "DryRun": False,
    })
    assert q.list("SnapshotId") == ["snap-1", "snap-2"]
    assert q.list("Owner") == ["self", "123456789012"]
    assert q.list("RestorableBy") == ["all"]
    assert q.filters() == {"volume-id": ["vol-1"], "tag-key": ["x", "y"]}
    assert q.int("MaxResults") == 10 and q.str("NextToken") == "n" and q.bool("DryRun", default=True) is False
    assert q.unknown({"SnapshotId", "Owner", "RestorableBy", "Filter", "MaxResults", "NextToken", "DryRun"}) == []


def test_other_volume_actions_scalars() -> None:
    q = roundtrip("AttachVolume", {"Device": "/dev/sdf", "InstanceId": "i-0abc", "VolumeId": "vol-1"})
    assert (q.str("Device"), q.str("InstanceId"), q.str("VolumeId", required=True)) == ("/dev/sdf", "i-0abc", "vol-1")
    q = roundtrip("DetachVolume", {"VolumeId": "vol-1", "Force": True})
    assert q.bool("Force") is True and q.str("InstanceId") is None
    q = roundtrip("ModifyVolume", {"VolumeId": "vol-1", "Size": 200, "VolumeType": "io2", "Iops": 5000})
    assert q.int("Size") == 200 and q.int("Iops") == 5000
    q = roundtrip("CreateSnapshot", {"VolumeId": "vol-1", "Description": "nightly & more",
                                     "TagSpecifications": [{"ResourceType": "snapshot",
                                                            "Tags": [{"Key": "k", "Value": "v"}]}]})
    assert q.str("Description") == "nightly & more"
    assert q.tag_specifications() == [("snapshot", {"k": "v"})]


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(_TEXT, max_size=30),
       filters=st.dictionaries(_TEXT.filter(bool), st.lists(_TEXT, min_size=1, max_size=5), max_size=6),
       tags=st.dictionaries(_TEXT, _TEXT, min_size=1, max_size=10))
def test_botocore_serialisation_round_trips_exactly(ids: list[str], filters: dict[str, list[str]],
                                                    tags: dict[str, str]) -> None:
    q = roundtrip("DescribeVolumes", {"VolumeIds": ids,
                                      "Filters": [{"Name": k, "Values": v} for k, v in filters.items()]})
    assert q.list("VolumeId") == ids
    assert q.filters() == filters
    tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
    q = roundtrip("CreateTags", {"Resources": ["vol-1"], "Tags": tag_list})
    assert q.tags() == tags
    q = roundtrip("CreateVolume", {"AvailabilityZone": "az", "TagSpecifications": [{"ResourceType": "volume",
                                                                                    "Tags": tag_list}]})
    assert q.tag_specifications() == [("volume", tags)]


# --- parse_form ---------------------------------------------------------------------------------------------


def test_parse_form_basics() -> None:
    assert parse_form(b"") == {}
    assert parse_form(b"A=1&&B=x+y%2Bz&C&D=%C3%A9&E=%zz") == {"A": "1", "B": "x y+z", "C": "", "D": "é", "E": "%zz"}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"Action=%ff", "not valid UTF-8"),
        (b"Action=\xff", "not valid UTF-8"),
        (b"Act%ffion=x", "not valid UTF-8"),
        (b"Action=a&Action=b", "given more than once"),
        (b"Action=a&Acti%6Fn=b", "given more than once"),
        (b"=x", "Invalid parameter name"),
        (b"Bad%20Name=x", "Invalid parameter name"),
        (b".Filter=x", "Invalid parameter name"),
        (b"Tag.1.Key=a%00b", "NUL"),
        (b"K" * 300 + b"=x", "longer than 256"),
        (b"K=" + b"v" * 40_000, "longer than 32768"),
        (b"&".join(b"P%d=1" % i for i in range(MAX_PARAMS + 1)), "more than 2000 parameters"),
        (b"a" * (MAX_BODY + 1), "larger than"),
    ],
)
def test_parse_form_refuses(body: bytes, match: str) -> None:
    with pytest.raises(InvalidParameter, match=match) as info:
        parse_form(body)
    assert info.value.code == "InvalidParameterValue" and info.value.status == 400


def test_parse_form_accepts_the_limits() -> None:
    assert len(parse_form(b"&".join(b"P%d=1" % i for i in range(MAX_PARAMS)))) == MAX_PARAMS
    assert parse_form(b"&" * MAX_BODY) == {}


# --- QueryParams errors ---------------------------------------------------------------------------------------


def q_of(**params: str) -> QueryParams:
    return QueryParams({k.replace("__", "."): v for k, v in params.items()})


def invalid(call: Any, match: str, code: str = "InvalidParameterValue") -> None:
    with pytest.raises(InvalidParameter, match=match) as info:
        call()
    assert info.value.code == code and info.value.status == 400


def missing(call: Any, match: str) -> None:
    with pytest.raises(MissingParameter, match=match) as info:
        call()
    assert info.value.code == "MissingParameter" and info.value.status == 400


def test_action_and_version() -> None:
    missing(lambda: q_of().action, "parameter Action")
    missing(lambda: q_of(Action="").action, "parameter Action")
    invalid(lambda: q_of(Action="Describe Volumes").action, "not valid for this web service", code="InvalidAction")
    assert q_of(Action="DescribeVolumes").version is None


def test_str_getter() -> None:
    q = q_of(VolumeId="vol-1", Empty="", Long="x" * 300)
    assert q.str("VolumeId", required=True) == "vol-1"
    assert q.str("Empty") == ""
    missing(lambda: q.str("Empty", required=True), "parameter Empty")
    missing(lambda: q.str("Absent", required=True), "parameter Absent")
    invalid(lambda: q.str("Long", max_len=255), "longer than 255")


def test_int_getter() -> None:
    q = q_of(Size="abc", Zero="0", Big="99999999999999999999", Neg="-5", Ok="+5", Space=" 5", Uni="٥", Under="1_0")
    invalid(lambda: q.int("Size"), r"Value \(abc\) for parameter Size is invalid")
    for name in ("Big", "Ok", "Space", "Uni", "Under"):
        invalid(lambda name=name: q.int(name), f"parameter {name} is invalid")
    invalid(lambda: q.int("Zero", min=1, max=16384), "between 1 and 16384")
    invalid(lambda: q.int("Neg", min=0), "at least 0")
    invalid(lambda: q_of(Size="20000").int("Size", max=16384), "at most 16384")
    missing(lambda: q.int("Absent", required=True), "parameter Absent")
    assert q.int("Neg") == -5 and q_of(Size="16384").int("Size", min=1, max=16384) == 16384


def test_bool_getter() -> None:
    q = q_of(A="TRUE", B="False", C="yes", D="1", E="")
    assert q.bool("A") is True and q.bool("B", default=True) is False
    assert q.bool("Absent") is False and q.bool("Absent", default=True) is True
    for name in ("C", "D", "E"):
        invalid(lambda name=name: q.bool(name), "Expected 'true' or 'false'")


def test_list_getter() -> None:
    assert q_of(VolumeId__3="c", VolumeId__1="a", VolumeId__10="d", VolumeId__2="b").list("VolumeId") == list("abcd")
    assert q_of(VolumeId__7="only").list("VolumeId") == ["only"]  # gaps are tolerated, like EC2
    assert q_of(VolumeId="").list("VolumeId") == []  # the plain query protocol's empty-list marker
    assert q_of(VolumeIds__1="x").list("VolumeId") == []
    assert q_of(VolumeId__999="x").list("VolumeId") == ["x"]
    for key in ("VolumeId.x", "VolumeId.0", "VolumeId.01", f"VolumeId.{MAX_INDEX + 1}", "VolumeId.999999999",
                "VolumeId.", "VolumeId.-1", "VolumeId.1e3"):
        invalid(lambda key=key: QueryParams({key: "v"}).list("VolumeId"), "index")
    invalid(lambda: q_of(VolumeId__1__Extra="v").list("VolumeId"), "Unexpected parameter VolumeId.1.Extra")
    invalid(lambda: q_of(VolumeId="vol-1").list("VolumeId"), "is a list")


def test_filters_getter() -> None:
    q = q_of(Filter__2__Name="b", Filter__2__Value__1="2", Filter__1__Name="a", Filter__1__Value__2="y",
             Filter__1__Value__1="x", Filter__3__Name="c")
    assert q.filters() == {"a": ["x", "y"], "b": ["2"], "c": []}
    assert list(q.filters()) == ["a", "b", "c"]
    missing(lambda: q_of(Filter__1__Value__1="x").filters(), "Filter.1.Name")
    missing(lambda: q_of(Filter__1__Name="").filters(), "Filter.1.Name")
    invalid(lambda: q_of(Filter__1__Name="a", Filter__2__Name="a").filters(), "more than once")
    invalid(lambda: q_of(Filter__1__Name="a", Filter__1__Values__1="x").filters(), "Unexpected parameter")
    invalid(lambda: q_of(Filter__1="a").filters(), "Unexpected parameter Filter.1.")
    invalid(lambda: q_of(Filter__1__Name="a", Filter__1__Value="x").filters(), "is a list")
    invalid(lambda: q_of(Filter__1__Name="a", Filter__1__Value__1__X="x").filters(), "Unexpected parameter")
    invalid(lambda: q_of(Filter__999999999__Value__1="x").filters(), "index")
    invalid(lambda: q_of(Filter__1__Name="a", Filter__1__Value__0="x").filters(), "index")
    invalid(lambda: q_of(Filter="status").filters(), "is a list")


def test_tags_getters() -> None:
    assert q_of(Tag__1__Key="a").tags() == {"a": ""}
    assert q_of(ResourceId__1="x", Tag__2__Key="b", Tag__2__Value="2").tags() == {"b": "2"}
    assert q_of(Foo__1__Key="k", Foo__1__Value="v").tags("Foo") == {"k": "v"}
    missing(lambda: q_of(Tag__1__Value="v").tags(), "Tag.1.Key")
    missing(lambda: q_of(Tag__1__Value="v").tag_keys(), "Tag.1.Key")
    invalid(lambda: q_of(Tag__1__Key="a", Tag__2__Key="a").tags(), "Duplicate tag key")
    assert q_of(Tag__1__Key="a", Tag__2__Key="a").tag_keys() == [("a", None), ("a", None)]
    invalid(lambda: q_of(Tag__1__Key="a", Tag__1__Other="b").tags(), "Unexpected parameter Tag.1.Other")
    invalid(lambda: q_of(Tag="a").tags(), "is a list")


def test_tag_specifications_getter() -> None:
    q = q_of(TagSpecification__1__ResourceType="volume", TagSpecification__1__Tag__1__Key="a",
             TagSpecification__1__Tag__1__Value="1", TagSpecification__2__ResourceType="snapshot",
             TagSpecification__2__Tag__1__Key="b")
    assert q.tag_specifications() == [("volume", {"a": "1"}), ("snapshot", {"b": ""})]
    # EC2 refuses a specification without tags (a client would believe it tagged something).
    invalid(lambda: q_of(TagSpecification__1__ResourceType="volume").tag_specifications(),
            "must have at least one tag")
    invalid(lambda: q_of(TagSpecification__1__Tags__1__Key="a").tag_specifications(), "Unexpected parameter")
    missing(lambda: q_of(TagSpecification__1__Tag__1__Value="a").tag_specifications(), "TagSpecification.1.Tag.1.Key")
    invalid(lambda: q_of(TagSpecification__1__Tag__1__Key="a", TagSpecification__1__Tag__2__Key="a")
            .tag_specifications(), r"Duplicate tag key \(a\) in TagSpecification.1.Tag.2.Key")
    invalid(lambda: q_of(TagSpecification="x").tag_specifications(), "is a list")


def test_unknown() -> None:
    q = q_of(Action="X", Version="v", Size="1", Filter__1__Name="a", Bogus="1", Zeta__1="z")
    assert q.unknown({"Size", "Filter"}) == ["Bogus", "Zeta"]
    assert "Size" in q and "Nope" not in q and len(q) == 6


# --- fuzzing: only 4xx VbsErrors, bounded time -----------------------------------------------------------------

_NAMES = ["Action", "Version", "Size", "Iops", "MaxResults", "DryRun", "Encrypted", "VolumeId", "SnapshotId",
          "ResourceId", "Owner", "Filter", "Tag", "TagSpecification", "NextToken"]


def exercise(q: QueryParams) -> None:
    """Every getter on every interesting name; each must return or raise a 4xx VbsError."""
    calls: list[Any] = [lambda: q.action, lambda: q.version, q.filters, q.tag_specifications, q.tags, q.tag_keys,
                        lambda: q.unknown(set(_NAMES)), lambda: q.tags("ResourceId")]
    for name in _NAMES:
        calls += [lambda name=name: q.str(name, required=True, max_len=64), lambda name=name: q.str(name),
                  lambda name=name: q.int(name, required=True, min=1, max=16384), lambda name=name: q.int(name),
                  lambda name=name: q.bool(name), lambda name=name: q.list(name)]
    for call in calls:
        try:
            call()
        except VbsError as exc:
            assert 400 <= exc.status < 500, exc
            assert exc.code in ("InvalidParameterValue", "MissingParameter", "InvalidAction"), exc


def check_body(body: bytes) -> None:
    try:
        params = parse_form(body)
    except VbsError as exc:
        assert exc.status == 400 and exc.code == "InvalidParameterValue", exc
        return
    exercise(QueryParams(params))


_PIECES = st.sampled_from([
    "Action", "Version", "Filter", "Name", "Value", "Tag", "Key", "TagSpecification", "ResourceType", "VolumeId",
    "Size", "DryRun", "MaxResults", ".", "..", "1", "2", "0", "01", "10", "999", "1000", "999999999", "-1", "x",
    "=", "&", "+", "%", "%2", "%zz", "%ff", "%C3%A9", "%C3", "%00", "%26", "%3D", "%2E", "true", "TRUE", "abc",
    "16384", "\xe9", " ",
])
_STRUCTURED = st.lists(st.lists(_PIECES, max_size=12).map("".join), max_size=40).map(
    lambda fields: "&".join(fields).encode("utf-8"))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(st.binary(max_size=2000), _STRUCTURED,
                      st.lists(st.tuples(_PIECES, _PIECES), max_size=30).map(
                          lambda pairs: b"&".join(f"{k}={v}".encode() for k, v in pairs))))
def test_any_body_yields_only_4xx_vbs_errors(body: bytes) -> None:
    check_body(body)


@settings(max_examples=300, deadline=None)
@given(params=st.dictionaries(st.lists(_PIECES, max_size=8).map("".join), st.text(max_size=20), max_size=30))
def test_any_mapping_yields_only_4xx_vbs_errors(params: dict[str, str]) -> None:
    exercise(QueryParams(params))


@pytest.mark.parametrize(
    "body",
    [
        b"Filter.999999999.Value.1=x",
        b"Filter.1.Name=a&Filter.1.Value.99999999999999999999999999=x",
        b"TagSpecification.1.Tag.1000.Key=a",
        b"VolumeId.1=a&VolumeId.1=b",
        b"Action=%ff%fe",
        b"%" * 5000,
        b"=" * 5000,
        b"Tag.1.Key=" + b"%E9" * 10,
        "Tag.1.Key=\ud800".encode("utf-8", "surrogatepass"),
    ],
)
def test_nasty_bodies(body: bytes) -> None:
    check_body(body)


def test_worst_case_bodies_finish_fast() -> None:
    worst = [
        # the maximum number of parameters, all feeding the nested getters
        b"&".join([b"Filter.%d.Name=f%d" % (i, i) for i in range(1, MAX_INDEX + 1)]
                  + [b"Filter.1.Value.%d=%s" % (i, b"v" * 400) for i in range(1, MAX_PARAMS - MAX_INDEX + 1)]),
        b"&".join(b"TagSpecification.%d.Tag.%d.Key=k%d" % (i % 999 + 1, i // 999 + 1, i) for i in range(MAX_PARAMS)),
        b"&".join(b"VolumeId.%d=vol-%d" % (i + 1, i) for i in range(MAX_INDEX)),
        b"&" * MAX_BODY,  # a million empty fields
        b"x" * MAX_BODY,  # one over-long name
        b"A=" + b"%41" * (MAX_BODY // 3 - 1),  # an over-long value in percent-escapes
        b"&".join([b"%ff=1"] * 100_000)[:MAX_BODY],
    ]
    for body in worst:
        started = time.process_time()
        check_body(body)
        # Bounded work, not speed (benchmarks measure speed): a quadratic parser takes minutes of CPU here.
        # This process's CPU time, which a loaded machine does not stretch as it stretches the clock.
        assert time.process_time() - started < 5.0, body[:60]
