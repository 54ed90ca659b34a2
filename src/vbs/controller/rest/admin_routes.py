"""The ``/v1`` routes of the operator (tag ``admin``, admin keys only): the controllers on the database,
and the check or repair of drift between the agents' inventory and the database."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends

from vbs.controller.cluster import describe_controllers
from vbs.controller.fleet.store_check import check_stores
from vbs.controller.rest.queries import Services, admin
from vbs.controller.rest.schemas.nodes import ControllerList


def admin_routes(r: APIRouter) -> None:
    @r.get("/controllers", response_model=ControllerList, tags=["admin"], dependencies=[Depends(admin)])
    def controllers(svc: Services) -> ControllerList:
        """The controllers on this database: live ones, their operations and singleton loops."""
        return ControllerList(controllers=describe_controllers(svc.db, svc.cfg.operation_lease_s))

    @r.get("/admin/check", tags=["admin"], dependencies=[Depends(admin)])
    def check(svc: Services, store: bool = False, deep: bool = False) -> dict[str, Any]:
        """Compare the agents' real inventory with the DB; change nothing. ``store=true``: also check
        the stored snapshots in their snapshot stores and list those not stored yet (``deep=true``:
        every chunk fetched and hashed again, as long as reading them all)."""
        report = svc.reconciler.run(repair=False).as_dict()
        if store or deep:
            stores = check_stores(svc, deep=deep)
            report["findings"] += [asdict(f) for f in stores.findings]
            report["clean"] = not report["findings"]
            report["stores"], report["unstored"] = stores.stores, stores.unstored
        return report

    @r.post("/admin/reconcile", tags=["admin"], dependencies=[Depends(admin)])
    def reconcile(svc: Services, now: bool = False) -> dict[str, Any]:
        """Repair drift now; ``now=true`` also removes orphans without waiting for their grace period."""
        return svc.reconciler.run(repair=True, ignore_grace=now).as_dict()
