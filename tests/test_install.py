"""VBS installed as docs/install.md says, and run as its systemd units run it.

The wheel is built from this tree with ``python -m build``, installed into a fresh venv of Debian's
python3 from a wheelhouse (tests/installed.py), and everything below runs that venv's ``vbs``: its
``--version``, ``bootstrap-key``, ``issue-cert``, ``node-token``, ``db upgrade`` on a real PostgreSQL,
then the three services started by the ``ExecStart`` lines of deploy/systemd/*.service (the venv's
``vbs`` in place of /opt/vbs/bin/vbs, a test config in place of /etc/vbs/vbs.toml), with mutual TLS
from the install's CA as on several machines, on free loopback ports; a volume is made and deleted
through the installed CLI, and a peer of another wire version is refused both ways. Each process is
stopped by its PID.
"""

from __future__ import annotations

import re
import signal
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import vbs
from tests.conftest import free_port, reap_daemons, stop_process, wait_until
from tests.installed import (
    REPO,
    ROLES,
    UNIT_CONFIG,
    UNIT_VBS,
    UNITS,
    Installed,
    clean_env,
    exec_start,
    newer_release,
    run,
    unit_lines,
)
from tests.installed_cluster import Install, new_install
from tests.postgres_cluster import PostgresForTests
from vbs.system.files import write_private
from vbs.versions import WIRE_VERSION

pytestmark = pytest.mark.integration


def test_the_wheel_holds_every_file_of_the_package(installed: Installed) -> None:
    """What src/vbs reads at run time (migrations, the console, profiles, the test guest's init) ships."""
    package = REPO / "src" / "vbs"
    files = {f"vbs/{p.relative_to(package)}" for p in package.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert {"vbs/controller/db/migrations/env.py", "vbs/controller/console/static/index.html",
            "vbs/profiles/hypervisor/virsh.toml", "vbs/rigs/testguest/init.sh"} <= files
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"vbs-{vbs.__version__}.dist-info/METADATA").decode()
    assert files - names == set()
    assert installed.wheel.name == f"vbs-{vbs.__version__}-py3-none-any.whl"
    assert f"\nVersion: {vbs.__version__}\n" in metadata


def test_the_venv_runs_the_installed_package_not_this_tree(installed: Installed) -> None:
    env = clean_env(installed.root / "home")
    where = run([installed.python, "-c", "import vbs; print(vbs.__file__)"], env=env, cwd=installed.root).stdout
    assert Path(where.strip()).is_relative_to(installed.venv), where
    said = run([installed.vbs, "--version"], env=env).stdout
    assert said == f"vbs {vbs.__version__} (wire version {WIRE_VERSION})\n"


def test_the_units_pass_systemd_analyze_verify(installed: Installed, tmp_path: Path) -> None:
    for name in ROLES.values():
        text = (UNITS / name).read_text()
        assert text.count(UNIT_VBS) == 1
        (tmp_path / name).write_text(text.replace(UNIT_VBS, str(installed.vbs)))
    proc = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / n) for n in ROLES.values())],
                          capture_output=True, text=True, timeout=120)
    # Any complaint (an unknown key, a bad value) is printed even where the exit status stays 0.
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    for role, name in ROLES.items():
        assert unit_lines(name, "ExecStart") == [f"{UNIT_VBS} {role} --config {UNIT_CONFIG}"]
        for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "Restart"):
            assert unit_lines(name, key) == [{"ProtectSystem": "strict", "Restart": "on-failure"}.get(key, "yes")]
        assert unit_lines(name, "StateDirectory") == [f"vbs/{role.removesuffix('-agent')}"]
        assert unit_lines(name, "RestrictAddressFamilies")


# -- an install run by its units --------------------------------------------------------------------


@pytest.fixture(scope="module")
def running(installed: Installed, postgres: PostgresForTests,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    inst = new_install(installed, tmp_path_factory.mktemp("cluster"), postgres.new_database())
    # The controller's machine: its first key, the CA and every node's certificate, the nodes' tokens,
    # the database's schema (docs/install.md).
    inst.vbs("bootstrap-key", "--data-dir", f"{inst.dir}/controller")
    inst.issue_credentials()
    inst.vbs("db", "upgrade", "--config", str(inst.config))
    inst.vbs("db", "status", "--config", str(inst.config))
    try:
        for role in ROLES:
            inst.start(role)
        inst.wait_up()
        yield inst
    finally:
        inst.stop_all()


def test_an_install_run_by_its_units_makes_and_deletes_a_volume(running: Install) -> None:
    for collection, name in (("storage_nodes", "storage-1"), ("hosts", "host-1")):
        node = running.node(collection, name)
        assert node is not None and (node["vbs_version"], node["wire_version"]) == (vbs.__version__, WIRE_VERSION)
    made = running.json("create-volume", "--size", "1", "--wait")
    volume_id = made["volume_id"]
    assert re.fullmatch(r"vol-[0-9a-f]{17}", volume_id)
    (found,) = running.json("describe-volumes", volume_id)["volumes"]
    assert (found["status"], found["size_gib"], found["storage_node"]) == ("available", 1, "storage-1")
    volume_file = running.dir / "pools" / "default" / "volumes" / f"{volume_id}.raw"
    assert volume_file.stat().st_size == 1 << 30
    running.vbs("delete-volume", volume_id, "--wait")
    (gone,) = running.json("describe-volumes", volume_id)["volumes"]
    assert gone["status"] == "deleted" and not volume_file.exists()
    # Every service runs the venv's vbs, as its unit does, and is still up.
    for role, proc in running.procs.items():
        assert proc.poll() is None, running.log(role)[-3000:]
        assert bytes(running.installed.vbs) in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")


def test_a_peer_of_another_wire_version_is_refused_both_ways(running: Install) -> None:
    d, newer = running.dir, str(WIRE_VERSION + 1)
    claims = {"x-vbs-version": "99.0.0", "x-vbs-wire": newer}
    token = (d / "storage-1.token").read_text().strip()
    # An agent (storage-1's own token and certificate) claiming a newer wire version: its heartbeat is
    # refused on its head, and the node keeps the version its real agent reported.
    with httpx.Client(verify=running.tls_as(d / "tls" / "storage-1"), timeout=60) as http:
        r = http.post(f"{running.endpoint}/internal/v1/storage-heartbeat", json={},
                      headers={"authorization": f"Bearer {token}", **claims})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "UnsupportedWireVersion"
    assert error["message"].startswith(f"the controller runs VBS {vbs.__version__}, which serves wire versions ")
    assert f"the caller runs VBS 99.0.0 and speaks wire version {newer}" in error["message"]
    node = running.node("storage_nodes", "storage-1")
    assert node is not None and node["vbs_version"] == vbs.__version__
    # A controller (its certificate, the token it calls storage-1 with) claiming the same: the agent refuses.
    with httpx.Client(verify=running.tls_as(d / "controller" / "tls" / "controller"), timeout=60) as http:
        r = http.get(f"https://127.0.0.1:{running.ports['storage']}/v1/pools/default/volumes/vol-0123456789abcdef0",
                     headers={"authorization": f"Bearer {token}", **claims})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"storage agent storage-1 runs VBS {vbs.__version__}")
    assert f"the caller runs VBS 99.0.0 and speaks wire version {newer}" in message
    wait_until(lambda: "refused a call to /v1/pools/default/volumes" in running.log("storage-agent"), 30,
               what="the agent's log line")


def test_a_real_agent_of_a_newer_wire_version_is_refused_naming_both_versions(running: Install) -> None:
    """A storage agent of a later release that speaks only wire version 2 (tests/installed.py
    newer_release), started as its unit starts it: each of its heartbeats is refused on its head, both
    sides say why with both versions, and it never joins."""
    newer_vbs = newer_release(running.installed, "venv-newer", release="99.0.0", wire=WIRE_VERSION + 1)
    d = running.dir
    running.vbs("issue-cert", "storage-2", "--host", "127.0.0.1", "--data-dir", f"{d}/controller", "--out-dir",
                f"{d}/tls")
    write_private(d / "storage-2.token", running.vbs("node-token", "storage-2", "--kind", "storage", "--data-dir",
                                                     f"{d}/controller").stdout)
    (d / "pools" / "storage-2").mkdir()
    config = d / "storage-2.toml"
    config.write_text(f'''
[storage_agent]
host = "127.0.0.1"
port = {free_port()}
node_name = "storage-2"
controller_url = "{running.endpoint}"
agent_token_file = "{d}/storage-2.token"
pool_path = "{d}/pools/storage-2"
state_dir = "{d}/storage-2"
export_host = "127.0.0.1"
nbd_port = {free_port()}
tls_cert = "{d}/tls/storage-2.pem"
tls_key = "{d}/tls/storage-2-key.pem"
tls_ca = "{running.ca}"
''')
    argv = exec_start("storage-agent", newer_vbs, config)
    log = d / "storage-2.log"
    agent = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=running.env, cwd="/")
    try:
        why = (f"the controller runs VBS {vbs.__version__}, which serves wire versions {WIRE_VERSION}; the caller "
               f"runs VBS 99.0.0 and speaks wire version {WIRE_VERSION + 1}: refused")
        wait_until(lambda: why in log.read_text(errors="replace") or agent.poll() is not None, 180, 0.5,
                   what="storage-2's log of its refused heartbeat")
        assert agent.poll() is None, log.read_text(errors="replace")[-3000:]
        assert "heartbeat failed: " + why in log.read_text(errors="replace")
        assert f"refused a call to /internal/v1/storage-heartbeat: {why}" in running.log("controller")
        assert running.node("storage_nodes", "storage-2") is None
        assert running.node("storage_nodes", "storage-1") is not None
    finally:
        stop_process(agent, signal.SIGTERM, timeout=60)
        reap_daemons(d / "storage-2")
