"""The controller's services in one place, handed to API handlers and workflow steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vbs.config import ControllerConfig
from vbs.controller.db import Database
from vbs.controller.storage_client import StorageAgents

if TYPE_CHECKING:
    from vbs.controller.workflows import WorkflowEngine


@dataclass
class Services:
    cfg: ControllerConfig
    db: Database
    storage: StorageAgents
    engine: WorkflowEngine = field(init=False)
