"""The limit put on a writable FUSE export's connection (vbs.system.fuse_connections), on a stand-in for
the fusectl directory; the real one is set and proven in tests/test_local_path_connector.py."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbs.errors import DriverError
from vbs.system.fuse_connections import one_request_at_a_time

pytestmark = pytest.mark.unit


@pytest.fixture
def disk() -> Iterator[Path]:
    """A file on an anonymous-device file system (tmpfs), as a FUSE mount's file is."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        (Path(d) / "disk").write_bytes(b"")
        yield Path(d) / "disk"


def _connection(root: Path, path: Path) -> Path:
    connection = root / str(os.minor(path.stat().st_dev))
    connection.mkdir(parents=True)
    return connection


def test_the_connection_is_set_to_one_background_request_and_left_so(tmp_path: Path, disk: Path) -> None:
    setting = _connection(tmp_path / "ctl", disk) / "max_background"
    setting.write_text("12\n")
    one_request_at_a_time(disk, root=tmp_path / "ctl")
    assert setting.read_text() == "1\n"
    one_request_at_a_time(disk, root=tmp_path / "ctl")  # idempotent
    assert setting.read_text() == "1\n"


def test_a_limit_that_cannot_be_set_refuses_the_path(tmp_path: Path, disk: Path) -> None:
    with pytest.raises(DriverError, match="no FUSE control file system"):
        one_request_at_a_time(disk, root=tmp_path / "absent")
    (_connection(tmp_path / "ctl", disk) / "max_background").mkdir()  # cannot be read or written
    with pytest.raises(DriverError, match="cannot limit the FUSE connection"):
        one_request_at_a_time(disk, root=tmp_path / "ctl")
    with pytest.raises(DriverError, match="cannot read the FUSE mount"):
        one_request_at_a_time(disk.parent / "gone", root=tmp_path / "ctl")
