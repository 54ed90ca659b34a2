"""What a new user meets in the first minutes of ``vbs up``: the folders it names exist, and its banner
says what to paste into another shell."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.conftest import running_vbs_up
from vbs.cli.up import Child, _banner


@pytest.mark.integration
def test_vbs_up_makes_the_folders_it_names(tmp_path: Path) -> None:
    with running_vbs_up(tmp_path) as vbs:
        vms = vbs.data_dir / "vms"
        assert vms.is_dir(), "the README's QEMU line puts its QMP socket there"
        assert stat.S_IMODE(vms.stat().st_mode) == 0o700
        log = (tmp_path / "vbs-up.log").read_text()
        assert f"VMs found in {vms}" in log
        # The banner says what to paste, and names the key's files without printing the secret.
        assert f"export VBS_ENDPOINT={vbs.endpoint}\n" in log
        assert f"export AWS_SHARED_CREDENTIALS_FILE={vbs.data_dir / 'credentials'}" in log
        assert f"[{vbs.endpoint}] of {tmp_path / 'xdg' / 'vbs' / 'credentials'}" in log
        assert f"Web console: {vbs.endpoint}/console" in log
        assert vbs.key.secret_access_key not in log


@pytest.mark.unit
def test_the_banner_says_what_to_paste_into_another_shell() -> None:
    data = Path("/srv/vbs/var")
    agent = Child("storage-agent", "storage-1", "http://127.0.0.1:9", [], {})
    text = _banner(data, ["http://127.0.0.1:8770"], [agent], data / "up.json", tls=False,
                   cli_credentials=Path("/home/u/.config/vbs/credentials"))
    lines = text.splitlines()
    assert lines[0].startswith("VBS is up: endpoint http://127.0.0.1:8770")
    assert "  export VBS_ENDPOINT=http://127.0.0.1:8770" in lines
    assert any("[http://127.0.0.1:8770] of /home/u/.config/vbs/credentials" in line for line in lines)
    assert any(line.startswith("  export AWS_SHARED_CREDENTIALS_FILE=/srv/vbs/var/credentials") for line in lines)
    assert ("Web console: http://127.0.0.1:8770/console (sign in with the access key in "
            "/srv/vbs/var/credentials)") in lines
    tls = _banner(data, ["https://127.0.0.1:8770", "https://127.0.0.1:8771"], [agent], data / "up.json", tls=True)
    assert "  export VBS_ENDPOINT=https://127.0.0.1:8770,https://127.0.0.1:8771" in tls.splitlines()
    assert "  export VBS_CA_BUNDLE=/srv/vbs/var/ca.pem" in tls.splitlines()
