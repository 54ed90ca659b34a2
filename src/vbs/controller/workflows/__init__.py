"""Workflows: multi-step operations persisted step by step, that finish or roll back on their own."""

from vbs.controller.workflows.engine import Params, Step, StepContext, Workflow, WorkflowEngine

__all__ = ["WorkflowEngine", "Workflow", "Step", "StepContext", "Params"]
