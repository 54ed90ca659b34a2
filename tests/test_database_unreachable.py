"""A database that cannot be reached (a controller cut from PostgreSQL: docs/reliability.md "Partitions on
real links") answers a request 503 RetryLater, so the client goes on to another controller; never 500."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from vbs.controller.db import Database
from vbs.controller.db.session import _unreachable
from vbs.errors import RetryLater

pytestmark = pytest.mark.unit


def test_a_read_from_a_database_that_refuses_the_connection_is_answered_retry_later() -> None:
    db = Database("postgresql+psycopg://vbs@127.0.0.1:1/vbs")  # nothing listens on port 1
    try:
        with pytest.raises(RetryLater, match="did not answer this controller"), db.read() as s:
            s.execute(text("SELECT 1"))
    finally:
        db.engine.dispose()


def test_a_lost_connection_is_retried_only_when_nothing_can_have_changed() -> None:
    timed_out = OperationalError("connect", {}, psycopg.errors.ConnectionTimeout("connection timeout expired"))
    lost = OperationalError("COMMIT", {}, psycopg.OperationalError("consuming input failed: EOF"))
    assert _unreachable(timed_out, read=False) and _unreachable(timed_out, read=True)
    assert _unreachable(lost, read=True)
    assert not _unreachable(lost, read=False)  # the commit may have happened: a 500 says so, not "try again"
