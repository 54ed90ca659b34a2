"""The host agent's HTTP API: hot-plug a connection into a VM and unplug it, keyed by the disk serial.

Like the storage agent it keeps no records: attaching an attached serial or detaching an absent one
succeeds, so the controller may repeat any call after a crash.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query
from pydantic import BaseModel, ConfigDict, Field

from vbs.connection import Connection
from vbs.errors import InvalidParameter, VbsError
from vbs.host.hypervisors.base import DeviceBusy, HypervisorDriver, QoS
from vbs.web import install_error_handlers, token_checker

SERIAL_RE = re.compile(r"^vol[0-9a-f]{17}$")


class QosBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    iops: int | None = Field(None, ge=1, le=1_000_000)
    mbps: int | None = Field(None, ge=1, le=100_000)


class AttachBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    connection: Connection
    read_only: bool = False
    qos: QosBody | None = None


class ResizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    connection: Connection
    size_bytes: int = Field(ge=512, le=64 << 40, multiple_of=512, strict=True)


def _serial(serial: str) -> str:
    if not SERIAL_RE.match(serial):
        raise InvalidParameter(f"invalid disk serial {serial[:40]!r}: expecting a volume id without its dash")
    return serial


def create_app(driver: HypervisorDriver, token: str | None, node_name: str) -> FastAPI:
    app = FastAPI(title="VBS host agent", version="1")
    install_error_handlers(app)
    router = APIRouter(prefix="/v1", dependencies=[Depends(token_checker(token))])

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "node": node_name}

    @router.get("/vms")
    def list_vms() -> list[dict[str, Any]]:
        return [asdict(vm) for vm in driver.list_vms()]

    @router.put("/vms/{vm_id}/disks/{serial}")
    def attach(vm_id: str, serial: str, body: AttachBody) -> dict[str, Any]:
        qos = QoS(iops=body.qos.iops, mbps=body.qos.mbps) if body.qos else None
        disk = driver.attach(vm_id, body.connection, _serial(serial), read_only=body.read_only, qos=qos)
        return asdict(disk)

    @router.delete("/vms/{vm_id}/disks/{serial}")
    def detach(vm_id: str, serial: str, force: bool = False,
               timeout: float = Query(10.0, gt=0, le=600)) -> dict[str, str]:
        try:
            driver.detach(vm_id, _serial(serial), force=force, timeout=timeout)
        except DeviceBusy as exc:
            raise VbsError(exc.message, code="DeviceBusy", status=409) from exc
        return {"state": "absent"}

    @router.put("/vms/{vm_id}/disks/{serial}/size")
    def resize(vm_id: str, serial: str, body: ResizeBody) -> dict[str, Any]:
        """Swap the disk onto a refreshed export of its (grown) volume and show the guest the new size."""
        disk = driver.resize(vm_id, _serial(serial), body.connection, body.size_bytes)
        return asdict(disk)

    @router.get("/vms/{vm_id}/disks")
    def list_disks(vm_id: str) -> list[dict[str, Any]]:
        return [asdict(d) for d in driver.list_disks(vm_id)]

    app.include_router(router)
    return app
