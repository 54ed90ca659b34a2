"""The controller's services in one place, handed to API handlers and workflow steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vbs.config import ControllerConfig
from vbs.controller.agents import AgentDirectory
from vbs.controller.db import Database

if TYPE_CHECKING:
    from vbs.controller.reconcile import Reconciler
    from vbs.controller.workflows import WorkflowEngine


@dataclass
class Services:
    cfg: ControllerConfig
    db: Database
    agents: AgentDirectory
    engine: WorkflowEngine = field(init=False)
    reconciler: Reconciler = field(init=False)
