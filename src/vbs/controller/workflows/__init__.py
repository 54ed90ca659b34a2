"""Workflows: multi-step operations persisted step by step, that finish or roll back on their own.

``definition`` says what a workflow is (``Workflow[P]``, its ``Step``s and typed ``Params``); ``engine``
runs them (with ``leases`` and the test ``faults``); one module per operation declares its workflow,
named after the verb it carries out (``attach_detach``, ``create_delete_volume``, ``snapshots``, …);
``registry`` lists every workflow the controller runs.
"""

from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow
from vbs.controller.workflows.engine import WorkflowEngine

__all__ = ["WorkflowEngine", "Workflow", "Step", "StepContext", "Params"]
