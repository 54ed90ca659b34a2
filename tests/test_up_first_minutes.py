"""What a new user meets in the first minutes of ``vbs up``: the folders it names exist, and its banner
says what to paste into another shell."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.conftest import running_vbs_up


@pytest.mark.integration
def test_vbs_up_makes_the_folders_it_names(tmp_path: Path) -> None:
    with running_vbs_up(tmp_path) as vbs:
        vms = vbs.data_dir / "vms"
        assert vms.is_dir(), "the README's QEMU line puts its QMP socket there"
        assert stat.S_IMODE(vms.stat().st_mode) == 0o700
        assert f"VMs found in {vms}" in (tmp_path / "vbs-up.log").read_text()
