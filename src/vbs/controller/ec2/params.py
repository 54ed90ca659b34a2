"""What every EC2 action shares: its parameters read and checked (ids, pages, tags, DryRun), a request
model's refusal in EC2's words (``InvalidParameterValue`` naming EC2's parameter), EC2's filter
semantics, and the answer of an action with nothing to describe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from vbs import ids
from vbs.controller.ec2.query import QueryParams
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.errors import InvalidParameter, MissingParameter, VbsError

ACCOUNT_ID = sharing.DEFAULT_ACCOUNT_ID
MAX_TOKEN = 160


class DryRunOperation(VbsError):
    code = "DryRunOperation"
    status = 412

    def __init__(self) -> None:
        super().__init__("Request would have succeeded, but DryRun flag is set.")


# The request models' field names, as EC2 clients know the parameters.
EC2_NAMES = {"size_gib": "Size", "snapshot_id": "SnapshotId", "volume_type": "VolumeType", "iops": "Iops",
             "throughput": "Throughput", "client_token": "ClientToken", "tags": "TagSpecification",
             "comment": "Description", "device": "Device", "instance_id": "InstanceId", "volume_id": "VolumeId",
             "multi_attach": "MultiAttachEnabled", "resource_ids": "ResourceId", "force": "Force",
             "availability_zone": "AvailabilityZone"}


def validated(model: type[Any], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        field = ".".join([EC2_NAMES.get(loc[0], loc[0]), *loc[1:]]) if loc else "request"
        value = str(first.get("input", ""))[:64] if not isinstance(first.get("input"), dict) else ""
        raise InvalidParameter(f"Value ({value}) for parameter {field} is invalid. {first['msg']}.") from None


def volume_id_of(value: str | None, name: str = "VolumeId") -> str:
    return _id_of(value, name, "volume", "vol-", "InvalidVolumeID.Malformed")


def snapshot_id_of(value: str | None, name: str = "SnapshotId") -> str:
    return _id_of(value, name, "snapshot", "snap-", "InvalidSnapshotID.Malformed")


def instance_id_of(value: str | None, name: str = "InstanceId") -> str:
    """An ``i-`` id; a cloud's ``SCHEME:ID`` is the attach action's to accept (it knows the resolvers)."""
    if not value:
        raise MissingParameter(f"The request must contain the parameter {name}.")
    if not ids.is_valid("instance", value):
        raise InvalidParameter(f'Invalid id: "{value[:64]}" (expecting "i-...")', code="InvalidInstanceID.Malformed")
    return value


def _id_of(value: str | None, name: str, kind: str, prefix: str, malformed: str) -> str:
    """The id in parameter ``name``: missing, or malformed (not of ``kind``'s prefix and shape) as EC2 says."""
    if not value:
        raise MissingParameter(f"The request must contain the parameter {name}.")
    if not ids.is_valid(kind, value):
        raise InvalidParameter(f'Invalid id: "{value[:64]}" (expecting "{prefix}...")', code=malformed)
    return value


def page_size(p: QueryParams, resource_ids: list[str], ids_name: str, largest: int) -> int | None:
    """MaxResults (at least 5; above ``largest`` answers ``largest``, as EC2 does), else ``largest`` per page;
    None where resource ids were given (they bound the answer and cannot be combined with MaxResults)."""
    asked = p.int("MaxResults", min=5)
    if resource_ids:
        if asked is not None:
            raise InvalidParameter(f"The parameter {ids_name} cannot be used with the parameter maxResults.",
                                   code="InvalidParameterCombination")
        return None
    return min(asked or largest, largest)


def describe_page(p: QueryParams, resource_ids: list[str], ids_name: str,
                  largest: int) -> tuple[dict[str, list[str]], int | None, str | None]:
    """A describe's filters, its page size (``page_size``) and its NextToken, read in this order (the
    first bad one is the error), then DryRun."""
    filters = p.filters()
    max_results = page_size(p, resource_ids, ids_name, largest)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    dry_run(p)
    return filters, max_results, token


def dry_run(p: QueryParams) -> None:
    if p.bool("DryRun"):
        raise DryRunOperation()


def act_unless_dry_run(p: QueryParams, act: Callable[[], object]) -> dict[str, Any]:
    """``act()`` unless DryRun asks only whether it would succeed; the answer of an action with nothing
    to describe (``<return>true</return>``)."""
    dry_run(p)
    act()
    return {"return": True}


def tag_set(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in sorted(values.items())]


def tags_for(p: QueryParams, resource_type: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for rtype, spec_tags in p.tag_specifications():
        if rtype not in (None, resource_type):
            raise InvalidParameter(f"The resource type '{rtype}' cannot be tagged by this action; "
                                   f"use '{resource_type}'.")
        out.update(spec_tags)
    return out


def matches(filters: dict[str, list[str]], facts: dict[str, list[str]], known: set[str]) -> bool:
    """EC2 filter semantics over a resource's facts: values of a name OR-ed, names AND-ed."""
    for name, values in filters.items():
        if name not in known and not name.startswith("tag:"):
            raise InvalidParameter(f"The filter '{name[:64]}' is invalid.")
        if not set(values) & set(facts.get(name, [])):
            return False
    return True
