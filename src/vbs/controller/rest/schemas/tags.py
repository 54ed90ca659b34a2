"""The REST models of tags: add tags to volumes and snapshots, or remove them by key."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from vbs.controller.rest.schemas.common import TAG_KEY_MAX, Tags, _Request


class CreateTagsRequest(_Request):
    resource_ids: list[str] = Field(min_length=1, max_length=1000)
    tags: Tags


class DeleteTagsRequest(_Request):
    resource_ids: list[str] = Field(min_length=1, max_length=1000)
    keys: list[Annotated[str, Field(min_length=1, max_length=TAG_KEY_MAX)]] = Field(default_factory=list)
