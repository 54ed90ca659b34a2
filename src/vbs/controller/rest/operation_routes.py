"""The ``/v1`` routes of operations (tag ``operations``): one operation (with ``wait``, once it ended),
and the timeline of a volume's or snapshot's operations; a user sees those of its tenant's only."""

from __future__ import annotations

from fastapi import APIRouter, Query
from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth.keys import Principal
from vbs.controller.db import Operation, OperationStep, Snapshot, Volume
from vbs.controller.db.states import UNFINISHED_OPERATION
from vbs.controller.requests.filters import page_limit
from vbs.controller.rest.queries import Caller, Services, max_results_query, settled_read, wait_query
from vbs.controller.rest.schemas.operations import OperationList, OperationOut, StepOut
from vbs.controller.runtime import Controller
from vbs.errors import NotFound


def operation_routes(r: APIRouter) -> None:
    @r.get("/operations/{operation_id}", response_model=OperationOut, tags=["operations"])
    async def get_operation(operation_id: str, svc: Services, who: Caller, wait: int = wait_query()) -> OperationOut:
        """Any operation to an admin; to a user, those on its tenant's volumes and snapshots. With ``wait``:
        answers once the operation ended, or after ``wait`` seconds with its current state (the CLI's --wait)."""
        return await settled_read(svc, operation_id, lambda: describe_operation(svc, operation_id, who),
                                  UNFINISHED_OPERATION, wait)

    @r.get("/operations", response_model=OperationList, tags=["operations"])
    def list_operations(svc: Services, who: Caller, resource_id: str = Query(max_length=32),
                        max_results: int | None = max_results_query()) -> OperationList:
        """The operations of one volume or snapshot, newest first (the web console's timeline)."""
        return operations_of(svc, resource_id, who, max_results)


def describe_operation(svc: Controller, operation_id: str, who: Principal) -> OperationOut:
    if not ids.is_valid("operation", operation_id):
        raise operation_not_found(operation_id)
    with svc.db.read() as s:
        op = s.get(Operation, operation_id)
        if op is None or not (who.is_admin or _owns(s, op.resource_id, who.tenant)):
            raise operation_not_found(operation_id)
        return _operation_out(s, op)


def operations_of(svc: Controller, resource_id: str, who: Principal, max_results: int | None) -> OperationList:
    """``resource_id``'s operations, newest first: any resource's to an admin, else its tenant's only
    (another tenant's volume has none, as it does not exist for this caller)."""
    kind = "volume" if resource_id.startswith("vol-") else "snapshot"
    ids.check(kind, resource_id)
    limit = page_limit(max_results, [])
    with svc.db.read() as s:
        if not (who.is_admin or _owns(s, resource_id, who.tenant)):
            return OperationList(operations=[])
        ops = s.scalars(select(Operation).where(Operation.resource_id == resource_id)
                        .order_by(Operation.created_at.desc(), Operation.id).limit(limit)).all()
        return OperationList(operations=[_operation_out(s, op) for op in ops])


def _operation_out(s: Session, op: Operation) -> OperationOut:
    steps = s.scalars(select(OperationStep).where(OperationStep.operation_id == op.id)
                      .order_by(OperationStep.position)).all()
    return OperationOut(operation_id=op.id, kind=op.kind, resource_id=op.resource_id, status=op.status,
                        error=op.error, attempts=op.attempts, created_at=op.created_at, updated_at=op.updated_at,
                        steps=[StepOut(name=st.name, state=st.state, error=st.error) for st in steps])


def operation_not_found(operation_id: str) -> NotFound:
    return NotFound(f"The operation '{operation_id[:40]}' does not exist.", code="InvalidOperation.NotFound")


def _owns(s: Session, resource_id: str, tenant: str) -> bool:
    table: type[Volume] | type[Snapshot] = Volume if resource_id.startswith("vol-") else Snapshot
    return s.scalar(select(table.tenant).where(table.id == resource_id)) == tenant
