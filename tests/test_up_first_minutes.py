"""What a new user meets in the first minutes of ``vbs up``: the folders it names exist, and its banner
says what to paste into another shell."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import VBS, free_port, running_vbs_up
from vbs.cli.up import Child
from vbs.cli.up_banner import banner, hypervisor_of
from vbs.trust import credentials


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
        assert f"  vbs demo-vm vm1 --data-dir {vbs.data_dir}   # " in log  # the qemu hypervisor, the default
        assert vbs.key.secret_access_key not in log
        # The saved key is the endpoint's under any of the machine's own names.
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("VBS_")},
               "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
        for endpoint in (vbs.endpoint.replace("127.0.0.1", "localhost") + "/", vbs.endpoint):
            r = subprocess.run([*VBS, "describe-volumes", "--output", "json"], capture_output=True, text=True,
                               env={**env, "VBS_ENDPOINT": endpoint}, cwd=tmp_path, timeout=120)
            assert r.returncode == 0, r.stderr
        # A browser at the endpoint lands on the console; the EC2 API at / answers as before.
        browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
        r = httpx.get(f"{vbs.endpoint}/", headers={"accept": browser}, follow_redirects=True)
        assert r.status_code == 200 and str(r.url) == f"{vbs.endpoint}/console/" and "<html" in r.text.lower()
        r = httpx.post(f"{vbs.endpoint}/", data={"Action": "DescribeVolumes"}, headers={"accept": browser})
        assert r.status_code == 401 and "AuthFailure" in r.text
        r = httpx.get(f"{vbs.endpoint}/?Action=DescribeVolumes", headers={"accept": browser})
        assert r.status_code == 401 and "AuthFailure" in r.text
    # Stopped cleanly: its key no longer sits in the user's file.
    assert f"[{vbs.endpoint}]" not in (tmp_path / "xdg" / "vbs" / "credentials").read_text()


@pytest.mark.integration
def test_an_agent_that_exits_during_start_up_is_started_again_on_new_ports_twice(tmp_path: Path) -> None:
    """A port vbs up picked free can be taken before the agent binds it ("address already in use", seen
    under load): the agent gets new ports and another start, twice at most, then vbs up gives up. Here the
    host agent fails every start (its configuration is refused), so each retry shows."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VBS_")},
           "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "VBS_HOST_AGENT_QMP_TIMEOUT_S": "-1"}
    r = subprocess.run([*VBS, "up", "--data-dir", str(tmp_path / "var"), "--port", str(free_port())],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    again = re.findall(r"host-1 exited during start-up \(code 1\); starting it again on (http://127\.0\.0\.1:\d+)",
                       r.stderr)
    assert len(again) == 2 and len(set(again)) == 2, r.stderr[-2000:]
    assert "vbs up: host-1 exited during start-up (code 1)" in r.stderr  # then it gave up


@pytest.mark.unit
def test_the_banner_says_what_to_paste_into_another_shell() -> None:
    data = Path("/srv/vbs/var")
    agent = Child("storage-agent", "storage-1", "http://127.0.0.1:9", [], {})
    text = banner(data, ["http://127.0.0.1:8770"], [agent], data / "up.json", tls=False,
                   cli_credentials=Path("/home/u/.config/vbs/credentials"))
    lines = text.splitlines()
    assert lines[0].startswith("VBS is up: endpoint http://127.0.0.1:8770")
    assert "  export VBS_ENDPOINT=http://127.0.0.1:8770" in lines
    assert any("[http://127.0.0.1:8770] of /home/u/.config/vbs/credentials" in line for line in lines)
    assert any(line.startswith("  export AWS_SHARED_CREDENTIALS_FILE=/srv/vbs/var/credentials") for line in lines)
    assert ("Web console: http://127.0.0.1:8770/console (sign in with the access key in "
            "/srv/vbs/var/credentials)") in lines
    assert not any("demo-vm" in line for line in lines)  # a host agent that finds no QMP sockets
    qemu = banner(data, ["http://127.0.0.1:8770"], [agent], data / "up.json", tls=False, demo_vm=True)
    assert any(line.startswith("  vbs demo-vm vm1 --data-dir /srv/vbs/var   # ") for line in qemu.splitlines())
    default = banner(Path("var"), ["http://127.0.0.1:8770"], [agent], Path("var/up.json"), tls=False, demo_vm=True)
    assert any(line.startswith("  vbs demo-vm vm1   # ") for line in default.splitlines())  # make run's ./var
    assert hypervisor_of(("--hypervisor", "libvirt")) == "libvirt" and hypervisor_of(()) == "qemu"
    tls = banner(data, ["https://127.0.0.1:8770", "https://127.0.0.1:8771"], [agent], data / "up.json", tls=True)
    assert "  export VBS_ENDPOINT=https://127.0.0.1:8770,https://127.0.0.1:8771" in tls.splitlines()
    assert "  export VBS_CA_BUNDLE=/srv/vbs/var/ca.pem" in tls.splitlines()


@pytest.mark.unit
@pytest.mark.parametrize("spelt", ["http://localhost:18770", "http://127.0.0.1:18770/", "http://[::1]:18770",
                                   "HTTP://LocalHost:18770/"])
def test_one_endpoint_under_the_machines_own_names(spelt: str) -> None:
    assert credentials.endpoint_key(spelt) == "http://127.0.0.1:18770"
    assert credentials.endpoint_key("https://ctl.example:8770/") == "https://ctl.example:8770"


@pytest.mark.unit
def test_saved_keys_are_found_by_any_spelling_and_pruned(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    key, other = credentials.generate(), credentials.generate()
    credentials.register_endpoint("http://127.0.0.1:18770/", key, env)
    assert credentials.for_client(["http://localhost:18770"], env) == key
    assert credentials.for_client(["http://[::1]:18770/"], env) == key
    assert "[http://127.0.0.1:18770]" in credentials.user_file(env).read_text()
    # An entry saved before (its exact URL text) is still read, and replaced when saved again.
    credentials.user_file(env).write_text(f"[http://localhost:18771/]\naws_access_key_id = {other.access_key_id}\n"
                                          f"aws_secret_access_key = {other.secret_access_key}\n")
    assert credentials.for_client(["http://127.0.0.1:18771"], env) == other
    credentials.register_endpoint("http://localhost:18772", key, env)
    credentials.register_endpoint("http://127.0.0.1:18771", key, env)
    assert "localhost" not in credentials.user_file(env).read_text()
    # A clean stop forgets its own key, not one another install wrote since.
    credentials.unregister_endpoint("http://localhost:18771", other, env)
    assert credentials.for_client(["http://127.0.0.1:18771"], env) == key
    credentials.unregister_endpoint("http://localhost:18771", key, env)
    assert credentials.for_client(["http://127.0.0.1:18771"], env) is None
    assert credentials.for_client(["http://127.0.0.1:18772"], env) == key


@pytest.mark.unit
def test_the_auth_hint_names_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vbs.cli.main import _auth_hint

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    hint = _auth_hint()
    assert str(tmp_path / "vbs" / "credentials") in hint and "./var/credentials" in hint
