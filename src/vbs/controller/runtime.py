"""The running controller as the API handlers see it: its services, workflow engine and reconciler."""

from __future__ import annotations

from dataclasses import dataclass

from vbs.controller.fleet.reconcile import Reconciler
from vbs.controller.resolvers import Resolvers
from vbs.controller.services import Services
from vbs.controller.workflows import WorkflowEngine


@dataclass
class Controller(Services):
    engine: WorkflowEngine
    reconciler: Reconciler
    resolvers: Resolvers
