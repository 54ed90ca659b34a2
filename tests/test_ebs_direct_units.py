"""The pieces under the EBS direct APIs, without a service: blocks put into a directory store and
completed into a manifest over a parent's (vbs.snapshot_store.direct), block and page tokens
(vbs.controller.ebs.tokens), the LINEAR checksum and SigV4 with an unsigned payload."""

from __future__ import annotations

import base64
import hashlib
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from vbs.controller.ebs.errors import Validation
from vbs.controller.ebs.tokens import BlockTokens, page_start, page_token
from vbs.controller.ec2 import sigv4
from vbs.errors import AuthFailure, InvalidParameter, SnapshotDataError
from vbs.snapshot_store import DirStore
from vbs.snapshot_store.direct import block_chunks, complete_snapshot, put_block, read_block
from vbs.snapshot_store.format import BLOCK_SIZE, chunk_key
from vbs.snapshot_store.manifests import find_manifest, load_manifest, markers

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
VOL = "vol-" + "f" * 17
MIB = 1 << 20


def snap_id(n: int) -> str:
    return f"snap-{n:017x}"


def test_blocks_become_chunks_and_zeros_are_not_stored(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    data = os.urandom(BLOCK_SIZE)
    cid = put_block(store, KEY, data)
    assert cid is not None and store.has(chunk_key(cid))
    assert put_block(store, KEY, data) == cid  # the same bytes: the same chunk
    assert put_block(store, KEY, bytes(BLOCK_SIZE)) is None
    with pytest.raises(InvalidParameter):
        put_block(store, KEY, data[:-1])


def test_a_child_is_its_parents_blocks_with_its_own_over_them(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    a, b, c = (os.urandom(BLOCK_SIZE) for _ in range(3))
    ids = {k: put_block(store, KEY, v) for k, v in (("a", a), ("b", b), ("c", c))}
    parent = complete_snapshot(store, snapshot_id=snap_id(1), volume_id=VOL, tenant="t1", tenant_key=KEY,
                               volume_size=4 * MIB, parent=None, blocks={0: ids["a"], 2: ids["b"], 5: None})
    assert find_manifest(store, snap_id(1)) == parent and not list(markers(store))
    child = complete_snapshot(store, snapshot_id=snap_id(2), volume_id=VOL, tenant="t1", tenant_key=KEY,
                              volume_size=8 * MIB, parent=parent, blocks={2: None, 7: ids["c"]})
    assert block_chunks(child) == {0: ids["a"], 7: ids["c"]}
    assert child.parent_snapshot_id == snap_id(1)
    assert read_block(store, load_manifest(store, snap_id(2)), 7, KEY) == c
    assert read_block(store, child, 2, KEY) == bytes(BLOCK_SIZE)
    with pytest.raises(InvalidParameter):  # past the end
        complete_snapshot(store, snapshot_id=snap_id(3), volume_id=VOL, tenant="t1", tenant_key=KEY,
                          volume_size=MIB, parent=None, blocks={2: ids["a"]})
    with pytest.raises(InvalidParameter):  # another tenant's parent
        complete_snapshot(store, snapshot_id=snap_id(3), volume_id=VOL, tenant="t2", tenant_key=KEY,
                          volume_size=8 * MIB, parent=parent, blocks={})


def test_a_chunk_lost_before_completion_fails_it_named_and_writes_nothing(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    cid = put_block(store, KEY, os.urandom(BLOCK_SIZE))
    assert cid is not None
    store.delete(chunk_key(cid))  # as a garbage collection past the grace period would
    with pytest.raises(SnapshotDataError, match="block 3"):
        complete_snapshot(store, snapshot_id=snap_id(4), volume_id=VOL, tenant="t1", tenant_key=KEY,
                          volume_size=4 * MIB, parent=None, blocks={3: cid})
    assert find_manifest(store, snap_id(4)) is None and not list(markers(store))


def test_block_tokens_open_one_block_of_one_snapshot_until_they_expire() -> None:
    tokens = BlockTokens("ab" * 32)
    token = tokens.make(snap_id(1), 7, expires=1000)
    tokens.check(token, snap_id(1), 7, now=999)
    raw = base64.b64decode(token)
    bad = [tokens.make(snap_id(2), 7, 1000), tokens.make(snap_id(1), 8, 1000),
           base64.b64encode(raw[:-1] + bytes([raw[-1] ^ 1])).decode(), BlockTokens("cd" * 32).make(snap_id(1), 7, 1000),
           "not a token", ""]
    for other in bad:
        with pytest.raises(Validation) as exc:
            tokens.check(other, snap_id(1), 7, now=999)
        assert exc.value.reason == "INVALID_BLOCK_TOKEN"
    with pytest.raises(Validation, match="expired"):
        tokens.check(token, snap_id(1), 7, now=1001)


def test_page_tokens_go_back_to_their_own_listing_only() -> None:
    assert page_start(page_token(snap_id(1), 4096), snap_id(1)) == 4096
    for token in (page_token(snap_id(2), 1), "!!", base64.b64encode(b"junk").decode()):
        with pytest.raises(Validation) as exc:
            page_start(token, snap_id(1))
        assert exc.value.reason == "INVALID_PAGE_TOKEN"


def _signed(body: bytes, *, unsigned: bool, sign_checksum: bool) -> dict[str, str]:
    """Headers of a PUT signed as botocore signs PutSnapshotBlock (the payload unsigned when asked)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    headers = {"x-amz-checksum": base64.b64encode(hashlib.sha256(body).digest()).decode()}
    if unsigned:
        headers["x-amz-content-sha256"] = "UNSIGNED-PAYLOAD"
    req = AWSRequest("PUT", "http://127.0.0.1:1/snapshots/snap-0/blocks/0", data=body, headers=headers)

    class Signer(SigV4Auth):
        def _should_sha256_sign_payload(self, request: AWSRequest) -> bool:
            return not unsigned

        def headers_to_sign(self, request: AWSRequest) -> object:
            signed = super().headers_to_sign(request)
            if not sign_checksum:
                del signed["x-amz-checksum"]  # type: ignore[attr-defined]
            return signed

    Signer(Credentials("AKIDEXAMPLE", "secret"), "ebs", "us-east-1").add_auth(req)
    return {"host": "127.0.0.1:1", **dict(req.headers.items())}  # what the client's HTTP layer adds


@pytest.mark.parametrize(("unsigned", "sign_checksum", "accepted"),
                         [(False, True, True), (True, True, True), (True, False, False)])
def test_an_unsigned_payload_needs_its_checksum_signed(unsigned: bool, sign_checksum: bool, accepted: bool) -> None:
    body = os.urandom(64)
    headers = _signed(body, unsigned=unsigned, sign_checksum=sign_checksum)
    now = datetime.strptime(headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)

    def verify(service: str = "ebs", vouched: str | None = "x-amz-checksum") -> str:
        return sigv4.verify("PUT", "/snapshots/snap-0/blocks/0", "", headers, body, {"AKIDEXAMPLE": "secret"},
                            region="us-east-1", service=service, now=now, unsigned_payload_vouched_by=vouched)

    if accepted:
        assert verify() == "AKIDEXAMPLE"
    else:
        with pytest.raises(AuthFailure):
            verify()
    with pytest.raises(AuthFailure):
        verify(service="ec2")  # scoped to ebs
    if unsigned:
        with pytest.raises(AuthFailure):
            verify(vouched=None)  # an API that takes no unsigned body refuses it
