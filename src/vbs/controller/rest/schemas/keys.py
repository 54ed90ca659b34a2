"""The REST models of access keys: create one for a tenant and role, and the answers that list them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import _Request


class CreateKeyRequest(_Request):
    tenant: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    role: Literal["admin", "user", "metrics"] = "user"


class KeyOut(BaseModel):
    access_key_id: str
    tenant: str
    role: str
    bootstrap: bool = False
    # Only in the answer to the request that made the key: it is never shown again.
    secret_access_key: str | None = None


class KeyList(BaseModel):
    keys: list[KeyOut]
