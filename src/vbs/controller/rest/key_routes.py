"""The ``/v1`` routes of access keys (tag ``keys``, admin keys only): create, rotate, list and delete
them; a key's secret is shown once, in the answer that made it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from vbs.controller.auth.keys import KeyStore
from vbs.controller.rest.queries import admin
from vbs.controller.rest.schemas.keys import CreateKeyRequest, KeyList, KeyOut


def key_routes(r: APIRouter) -> None:
    @r.post("/keys", response_model=KeyOut, tags=["keys"], dependencies=[Depends(admin)])
    def create_key(body: CreateKeyRequest, request: Request) -> KeyOut:
        key = _key_store(request).create(body.tenant, body.role)
        return KeyOut(access_key_id=key.access_key_id, tenant=body.tenant, role=body.role,
                      secret_access_key=key.secret_access_key)

    @r.post("/keys/{access_key_id}/rotate", response_model=KeyOut, tags=["keys"], dependencies=[Depends(admin)])
    def rotate_key(access_key_id: str, request: Request) -> KeyOut:
        """A new key for the same tenant and role; the old one works until it is deleted (no downtime)."""
        key, info = _key_store(request).successor(access_key_id)
        return KeyOut(access_key_id=key.access_key_id, tenant=info.tenant, role=info.role,
                      secret_access_key=key.secret_access_key)

    @r.get("/keys", response_model=KeyList, tags=["keys"], dependencies=[Depends(admin)])
    def list_keys(request: Request) -> KeyList:
        return KeyList(keys=[KeyOut(access_key_id=k.access_key_id, tenant=k.tenant, role=k.role,
                                    bootstrap=k.bootstrap) for k in _key_store(request).list()])

    @r.delete("/keys/{access_key_id}", tags=["keys"], dependencies=[Depends(admin)])
    def delete_key(access_key_id: str, request: Request) -> dict[str, bool]:
        _key_store(request).delete(access_key_id)
        return {"return": True}


def _key_store(request: Request) -> KeyStore:
    return request.app.state.keys  # type: ignore[no-any-return]
