"""Drivers are found by name through entry points: a package VBS has never heard of adds one.

The plug-in here is a real installed distribution as Python sees one (a ``.dist-info`` with its
``entry_points.txt`` on the path), written by the test; nothing in VBS names it. The storage agent
picks it because its config says ``backend = "demo"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.conftest import VBS, Services, free_port, stop_process, wait_until
from vbs import drivers
from vbs.config import StorageAgentConfig
from vbs.errors import InvalidParameter
from vbs.storage.service import build_drivers

pytestmark = pytest.mark.unit

PLUGIN = '''
"""A third-party backend: a pool of files wherever its own option says, reporting itself as "demo"."""

from pathlib import Path

from vbs.storage.backends.file import FileBackend


class DemoBackend(FileBackend):
    @classmethod
    def from_config(cls, cfg, exports):
        options = cfg.options.get("demo", {})
        return cls(cfg.pool_name, Path(options["path"]), exports=exports, clone_method="copy")

    def pool_info(self):
        return super().pool_info().model_copy(update={"backend": "demo"})
'''


def install_plugin(site: Path) -> None:
    """What ``pip install vbs-demo-plugin`` leaves in site-packages."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "vbs_demo_plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist = site / "vbs_demo_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vbs-demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[vbs.backends]\ndemo = vbs_demo_plugin:DemoBackend\n")


def test_vbs_own_drivers_are_registered_by_name() -> None:
    assert {"nbd", "iscsi"} <= set(drivers.available("export"))
    assert "file" in drivers.available("backend")
    assert "qemu" in drivers.available("hypervisor")
    with pytest.raises(InvalidParameter, match="no backend driver named 'nosuch'; installed: .*file"):
        drivers.load("backend", "nosuch")


def test_a_driver_installed_as_a_package_is_picked_by_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    install_plugin(site)
    monkeypatch.syspath_prepend(str(site))
    pool = tmp_path / "demo-pool"
    pool.mkdir()
    cfg = StorageAgentConfig(backend="demo", state_dir=tmp_path / "state", options={"demo": {"path": str(pool)}},
                             nbd_socket_dir=tmp_path / "nbd")

    assert "demo" in drivers.available("backend")
    exports, backends = build_drivers(cfg)
    backend = backends["default"]

    assert type(backend).__name__ == "DemoBackend" and exports.protocol == "nbd"
    assert backend.pool_info().backend == "demo"
    backend.ensure_volume("vol-0123456789abcdef0", 1 << 20)
    assert (pool / "volumes" / "vol-0123456789abcdef0.raw").stat().st_size == 1 << 20


@pytest.mark.integration
def test_a_storage_agent_runs_a_plugin_backend_and_volumes_land_in_it(services: Services, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_plugin(site)
    pool = tmp_path / "demo-pool"
    pool.mkdir()
    config = tmp_path / "vbs.toml"
    config.write_text(f'[storage_agent]\nbackend = "demo"\n\n[storage_agent.options.demo]\npath = "{pool}"\n')
    services.start_controller()
    port = free_port()
    env = {**services.node_env("storage", "storage-1"), "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    agent = subprocess.Popen(
        [*VBS, "storage-agent", "--config", str(config), "--port", str(port), "--controller-url",
         services.vbs.endpoint, "--state-dir", str(tmp_path / "state"), "--nbd-port", str(free_port())],
        env=env, stdout=(tmp_path / "agent.log").open("ab"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, 60, what="agent")
        nodes = wait_until(lambda: [n for n in services.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
                                    if n["state"] == "up"], 60, what="the agent's heartbeat")
        assert nodes[0]["pools"][0]["backend"] == "demo"

        vol = services.vbs.create_volume(size_gib=1)
        services.vbs.wait_volume(vol["volume_id"], "available")

        assert (pool / "volumes" / f"{vol['volume_id']}.raw").stat().st_size == 1 << 30
        assert not (services.data_dir / "pool" / "volumes" / f"{vol['volume_id']}.raw").exists()
    finally:
        stop_process(agent)
