"""``vbs bootstrap-key``: an install's first access key where a controller started by hand (or by its
systemd unit) reads it, and the secrets its controllers share (docs/install.md), made once, private, the
key's secret never printed."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VBS
from vbs.trust import credentials

pytestmark = pytest.mark.unit


def bootstrap(data_dir: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    proc = subprocess.run([*VBS, "bootstrap-key", "--data-dir", str(data_dir)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_first_key_is_made_once_private_and_its_secret_never_printed(tmp_path: Path) -> None:
    data_dir = tmp_path / "controller"
    said = bootstrap(data_dir)
    path = data_dir / "credentials"
    (key,) = credentials.read(path, "default")
    assert key.access_key_id in said and key.secret_access_key not in said and str(path) in said
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    secrets = {name: (data_dir / name).read_bytes() for name in ("credentials", "node-secret", "master.key")}
    for name in secrets:
        assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name
    # Again: the same key and secrets, kept.
    assert key.secret_access_key not in bootstrap(data_dir)
    assert {name: (data_dir / name).read_bytes() for name in secrets} == secrets
