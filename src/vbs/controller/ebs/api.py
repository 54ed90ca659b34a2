"""The EBS direct APIs' routes on the controller's endpoint, as botocore's ``ebs`` model (2019-11-02) has
them: rest-json, SigV4 scoped to ``ebs`` (a bearer key works too), AWS's error shape (the
``x-amzn-ErrorType`` header and ``{"Message", "Reason"}``).

PutSnapshotBlock's body may go unsigned (``UNSIGNED-PAYLOAD``, as botocore sends it) only with its
``x-amz-Checksum`` header signed: the block is checked against that checksum before anything is kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.auth.keys import Principal
from vbs.controller.aws_json import Handler, Service, parse_body, refusal
from vbs.controller.ebs import reads, writes
from vbs.controller.ebs.encryption import check_combination, kms_key_arn
from vbs.controller.ebs.errors import EbsError, Validation, ebs_error_of
from vbs.controller.requests.snapshot_permissions import owner_id
from vbs.controller.rest.schemas.common import COMMENT_MAX, check_tags
from vbs.controller.runtime import Controller
from vbs.errors import VbsError
from vbs.snapshot_store.format import BLOCK_SIZE

__all__ = ["install", "is_ebs_path", "ebs_refusal"]

_SNAPSHOTS = "/snapshots"
_INT_RE = re.compile(r"[0-9]{1,19}")


def is_ebs_path(path: str) -> bool:
    return path == _SNAPSHOTS or path.startswith(_SNAPSHOTS + "/")


def ebs_refusal(exc: VbsError) -> Response:
    """An error as the ``ebs`` service answers it."""
    return refusal(ebs_error_of(exc))


class _Tag(BaseModel):
    model_config = ConfigDict(extra="forbid")
    Key: str = Field(min_length=1, max_length=127)
    Value: str = Field("", max_length=255)


class _Start(BaseModel):
    model_config = ConfigDict(extra="forbid")
    VolumeSize: int = Field(ge=1, le=65536, strict=True)
    ParentSnapshotId: str | None = Field(None, max_length=64)
    Tags: list[_Tag] = Field(default_factory=list, max_length=50)
    Description: str = Field("", max_length=COMMENT_MAX)
    ClientToken: str | None = Field(None, min_length=1, max_length=255, pattern=r"^\S+$")
    Encrypted: bool | None = None
    KmsKeyArn: str | None = Field(None, min_length=1, max_length=2048)
    Timeout: int = Field(writes.DEFAULT_TIMEOUT_MIN, ge=10, le=4320, strict=True)


def _int(value: str | None, what: str, default: int | None = None) -> int | None:
    if value is None:
        return default
    if not _INT_RE.fullmatch(value):
        raise Validation(f"{what} must be a whole number, not {value[:32]!r}.")
    return int(value)


def _epoch(when: datetime) -> float:
    return when.timestamp()


def _start_request(body: bytes) -> writes.StartRequest:
    req = parse_body(_Start, body, Validation)
    check_combination(req.Encrypted, req.KmsKeyArn, req.ParentSnapshotId)
    tags = {t.Key: t.Value for t in req.Tags}
    try:
        check_tags(tags)
    except ValueError as exc:
        raise Validation(f"Invalid tags: {exc}.", "INVALID_TAG") from None
    return writes.StartRequest(volume_size_gib=req.VolumeSize, parent_snapshot_id=req.ParentSnapshotId, tags=tags,
                               description=req.Description, client_token=req.ClientToken, timeout_min=req.Timeout,
                               encrypted=req.Encrypted, kms_key_arn=req.KmsKeyArn)


def install(app: FastAPI, auth: Authenticator) -> None:
    ebs = Service(app, auth, "ebs", body_max=BLOCK_SIZE, refuse=ebs_refusal, internal=lambda: EbsError(
        "An internal error has occurred."), too_large=lambda: Validation(
        f"The request body is larger than a block ({BLOCK_SIZE} bytes)."))

    def route(path: str, method: str, status: int, *, unsigned_ok: bool = False) -> Callable[[Handler], Any]:
        return ebs.route(path, method, status,
                         unsigned_payload_vouched_by="x-amz-checksum" if unsigned_ok else None)

    @route("/snapshots", "POST", 201)
    def start(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        req = _start_request(body)
        snap = writes.start_snapshot(svc, req, who.tenant)
        out: dict[str, Any] = {
            "SnapshotId": snap.id, "OwnerId": owner_id(who.tenant), "Status": snap.status,
            "StartTime": _epoch(snap.started_at), "VolumeSize": snap.volume_size_gib, "BlockSize": BLOCK_SIZE,
            "Description": snap.comment, "SseType": "none",
            "Tags": [{"Key": k, "Value": v} for k, v in sorted(req.tags.items())],
        }
        if req.parent_snapshot_id:
            out["ParentSnapshotId"] = req.parent_snapshot_id
        if snap.key_id is not None:
            with svc.db.read() as s:
                out["KmsKeyArn"] = kms_key_arn(s, svc, who.tenant, snap.key_id)
        return out

    @route("/snapshots/{snapshotId}/blocks/{blockIndex}", "PUT", 201, unsigned_ok=True)
    def put(request: Request, svc: Controller, who: Principal, body: bytes) -> Response:
        h = request.headers
        checksum = writes.put_block(
            svc, who.tenant, request.path_params["snapshotId"],
            _int(request.path_params["blockIndex"], "BlockIndex") or 0, body,
            data_length=_int(h.get("x-amz-data-length"), "DataLength", -1) or 0,
            checksum=h.get("x-amz-checksum"), algorithm=h.get("x-amz-checksum-algorithm"),
            progress=_int(h.get("x-amz-progress"), "Progress"))
        return Response(status_code=201, headers={"x-amz-Checksum": checksum, "x-amz-Checksum-Algorithm": "SHA256"})

    @route("/snapshots/completion/{snapshotId}", "POST", 202)
    def complete(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        h = request.headers
        count = _int(h.get("x-amz-changedblockscount"), "ChangedBlocksCount")
        if count is None:
            raise Validation("The request must carry x-amz-ChangedBlocksCount.")
        status = writes.complete_snapshot(svc, who.tenant, request.path_params["snapshotId"], changed_blocks=count,
                                          checksum=h.get("x-amz-checksum"),
                                          algorithm=h.get("x-amz-checksum-algorithm"),
                                          aggregation=h.get("x-amz-checksum-aggregation-method"))
        return {"Status": status}

    @route("/snapshots/{snapshotId}/blocks", "GET", 200)
    def list_blocks(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        q = request.query_params
        page = reads.list_blocks(svc, who.tenant, request.path_params["snapshotId"],
                                 start=_int(q.get("startingBlockIndex"), "StartingBlockIndex", 0) or 0,
                                 page=q.get("pageToken"), max_results=_int(q.get("maxResults"), "MaxResults"))
        return _page(page, "Blocks", lambda i, _a, b: {"BlockIndex": i, "BlockToken": b})

    @route("/snapshots/{secondSnapshotId}/changedblocks", "GET", 200)
    def list_changed(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        q = request.query_params
        page = reads.list_changed_blocks(svc, who.tenant, request.path_params["secondSnapshotId"],
                                         q.get("firstSnapshotId"),
                                         start=_int(q.get("startingBlockIndex"), "StartingBlockIndex", 0) or 0,
                                         page=q.get("pageToken"), max_results=_int(q.get("maxResults"), "MaxResults"))

        def row(i: int, first: str | None, second: str | None) -> dict[str, Any]:
            out: dict[str, Any] = {"BlockIndex": i}
            if first is not None:
                out["FirstBlockToken"] = first
            if second is not None:
                out["SecondBlockToken"] = second
            return out
        return _page(page, "ChangedBlocks", row)

    @route("/snapshots/{snapshotId}/blocks/{blockIndex}", "GET", 200)
    def get(request: Request, svc: Controller, who: Principal, body: bytes) -> Response:
        token = request.query_params.get("blockToken")
        if not token:
            raise Validation("The request must carry a blockToken.", "INVALID_BLOCK_TOKEN")
        data, checksum = reads.get_block(svc, who.tenant, request.path_params["snapshotId"],
                                         _int(request.path_params["blockIndex"], "BlockIndex") or 0, token)
        return Response(data, media_type="application/octet-stream",
                        headers={"x-amz-Data-Length": str(len(data)), "x-amz-Checksum": checksum,
                                 "x-amz-Checksum-Algorithm": "SHA256"})


def _page(page: reads.Page, key: str, row: Callable[[int, str | None, str | None], dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {key: [row(i, a, b) for i, a, b in page.rows], "ExpiryTime": _epoch(page.expires),
                           "VolumeSize": page.volume_size_gib, "BlockSize": BLOCK_SIZE}
    if page.next_token is not None:
        out["NextToken"] = page.next_token
    return out
