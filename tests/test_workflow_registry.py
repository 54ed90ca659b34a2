"""The one registry of workflows: every kind once, and the overlap rules (docs/operations.md) read from it."""

import pytest

from vbs.controller.workflows.registry import EXCLUSIVE_KINDS, WORKFLOWS

pytestmark = pytest.mark.unit


def test_every_kind_is_registered_once() -> None:
    kinds = [w.kind for w in WORKFLOWS]
    assert len(kinds) == len(set(kinds))


def test_the_exclusive_workflows_are_those_that_exclude_each_other_on_a_volume_and_on_a_snapshot() -> None:
    assert EXCLUSIVE_KINDS == {
        "create-volume", "delete-volume", "attach-volume", "detach-volume", "modify-volume", "migrate-volume",
        "migrate-volume-copy", "migrate-volume-mirror", "migrate-instance", "delete-snapshot", "archive-snapshot",
        "restore-snapshot-tier",
    }
