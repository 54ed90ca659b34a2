"""The NBD export's file nodes on a file system that refuses the configured mode (no O_DIRECT: tmpfs):
served through the page cache, said once per pool at INFO, not a warning per snapshot. A snapshot's
copy target is written through the page cache by choice, on any file system: nothing was refused, and
nothing is said above DEBUG (issue 38 item 6: every snapshot on ext4 used to read as a fallback)."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from vbs.qemu.qmp import QmpCommandError
from vbs.storage.exports.nbd.chains import Chains

pytestmark = pytest.mark.unit


class Monitor:
    """A daemon whose file system takes every mode (ext4, XFS)."""

    def __init__(self) -> None:
        self.added: list[dict[str, Any]] = []

    def q(self, command: str, args: dict[str, Any]) -> None:
        self.added.append(args)


class NoDirectMonitor:
    """A daemon whose file system refuses O_DIRECT."""

    def __init__(self) -> None:
        self.added: list[dict[str, Any]] = []

    def q(self, command: str, args: dict[str, Any]) -> None:
        if args["cache"]["direct"]:
            raise QmpCommandError(command, "GenericError", "Could not open: Invalid argument")
        self.added.append(args)


def chains_of(monitor: Any) -> Chains:
    """Chains on a fake monitor: no limits, desired state or bitmaps (the node calls alone)."""
    return Chains(cast(Any, monitor), cast(Any, None), cast(Any, None), cast(Any, None), aio="native",
                  cache_direct=True)


def test_a_refused_mode_falls_back_and_is_said_once_per_pool_at_info(caplog: pytest.LogCaptureFixture) -> None:
    monitor = NoDirectMonitor()
    chains = chains_of(monitor)
    with caplog.at_level(logging.DEBUG, logger="vbs.storage.exports.nbd.chains"):
        for k in range(3):
            chains.add_file_node(f"n{k}", f"/pool/snap-{k}.qcow2", read_only=True, what=f"snap-{k}")
    assert [(a["cache"]["direct"], a["aio"]) for a in monitor.added] == [(False, "threads")] * 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "page cache" in r.getMessage()]
    assert len(told) == 1 and "nothing needs doing" in told[0] and "tmpfs" in told[0], told
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 1 + 2  # the first node's refusals


def test_a_copy_target_is_buffered_by_choice_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    monitor = Monitor()
    chains = chains_of(monitor)
    with caplog.at_level(logging.DEBUG, logger="vbs.storage.exports.nbd.chains"):
        chains.add_file_node("vol", "/pool/vol-1.raw", read_only=False, what="vol-1")
        for k in range(3):
            chains.add_file_node(f"t{k}", f"/pool/snapshots/snap-{k}.raw.partial", read_only=False,
                                 what=f"snap-{k}", buffered=True)
    assert [(a["cache"]["direct"], a["aio"]) for a in monitor.added] == [(True, "native")] + [(False, "threads")] * 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    # A volume's node that the file system does refuse is still said once, with what it means.
    refusing = NoDirectMonitor()
    chains = chains_of(refusing)
    with caplog.at_level(logging.DEBUG, logger="vbs.storage.exports.nbd.chains"):
        chains.add_file_node("t", "/pool/snapshots/snap-9.raw.partial", read_only=False, what="snap-9",
                             buffered=True)
        assert not [r for r in caplog.records if "page cache instead of O_DIRECT" in r.getMessage()]
        chains.add_file_node("v", "/pool/vol-2.raw", read_only=False, what="vol-2")
    assert len([r for r in caplog.records if "page cache instead of O_DIRECT" in r.getMessage()]) == 1


def test_tgtd_on_a_file_system_without_o_direct_is_said_once_at_info(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The iSCSI export's same case (tgtd's bsoflags=direct refused): once per driver, with what it means."""
    import errno

    from vbs.storage.exports.iscsi import targets

    def no_direct(path: str, flags: int, *args: Any) -> int:
        raise OSError(errno.EINVAL, "Invalid argument", path)

    monkeypatch.setattr(targets.os, "open", no_direct)
    driver = targets.Targets(cast(Any, None), cast(Any, None), lambda: None, direct_io=True, session_grace=1.0,
                               by_name=False)
    with caplog.at_level(logging.DEBUG, logger="vbs.storage.exports.iscsi.targets"):
        assert [driver._direct_ok(f"/pool/vol-{k}.raw") for k in range(3)] == [False] * 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(told) == 1 and "Nothing needs doing" in told[0] and "page cache" in told[0], told
