"""Host agents accept only connections they can trust: no raw file paths from the wire, and network
targets only at the storage node the controller vouches for.

The rogue storage agent here is the real one with its answers rewritten on the way out (what a
compromised storage node could send): a ``file`` connection to ``/etc/shadow``, or an NBD target on
another machine. The controller refuses both; the attach rolls back; the VM never sees a disk.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Services, node_token, start_bare_vm, stop_bare_vm, wait_until
from vbs import ids

pytestmark = pytest.mark.integration

# A storage agent whose connection answers are replaced by REWRITE (a JSON text) before they leave.
ROGUE = """
import json, sys
import vbs.storage.service as service
from vbs.cli.main import main

rewrite = json.loads(sys.argv.pop(1))
real_create_app = service.create_app

def create_app(*args, **kwargs):
    app = real_create_app(*args, **kwargs)
    inner = app.build_middleware_stack

    def stack():
        asgi = inner()

        async def rogue(scope, receive, send):
            if scope["type"] != "http" or "/connections/" not in scope["path"]:
                return await asgi(scope, receive, send)
            async def send_rewritten(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [(k, v) for k, v in message["headers"]
                                                      if k != b"content-length"]}
                elif message["type"] == "http.response.body" and b'"connection"' in message.get("body", b""):
                    body = json.loads(message["body"])
                    body["connection"] = {**body["connection"], **rewrite}
                    for key in [k for k, v in rewrite.items() if v is None]:
                        body["connection"].pop(key)
                    message = {**message, "body": json.dumps(body).encode()}
                await send(message)
            return await asgi(scope, receive, send_rewritten)
        return rogue

    app.build_middleware_stack = stack
    return app

service.create_app = create_app
sys.argv[0] = "vbs"
main()
"""


class RogueServices(Services):
    rewrite = "{}"

    def start_agent(self) -> None:
        argv = [sys.executable, "-c", ROGUE, self.rewrite, "storage-agent", "--port", str(self.agent_port),
                "--pool-path", str(self.data_dir / "pool"), "--controller-url", self.vbs.endpoint,
                "--state-dir", str(self.data_dir / "storage-state"), "--nbd-port", str(self.nbd_port)]
        self.agent = subprocess.Popen(argv, env=self.node_env("storage", "storage-1"), stdout=self._log("agent"),
                                      stderr=subprocess.STDOUT)
        wait_until(lambda: any(n["state"] == "up" for n in
                               self.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]), 60, what="agent")


@pytest.fixture(params=[
    ('{"protocol": "file", "path": "/etc/shadow", "host": null, "port": null, "export": null}', "file path"),
    ('{"host": "127.0.0.9"}', "another machine"),
], ids=["file-path", "foreign-target"])
def rogue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Services, subprocess.Popen[bytes]]]:
    svc = RogueServices(tmp_path)
    svc.rewrite = request.param[0]
    vm: subprocess.Popen[bytes] | None = None
    try:
        svc.start_controller()
        svc.start_agent()
        vm_dir = svc.start_host_agent("host-1")
        vm = start_bare_vm(vm_dir, "vm1", tmp_path / "vm1.log")
        wait_until(lambda: any(i["vm_id"] == "vm1" for i in svc.vbs.http.get("/v1/instances").json()["instances"]),
                   30, what="vm1")
        yield svc, vm
    finally:
        if vm is not None:
            stop_bare_vm(vm)
        svc.stop()


def test_a_rogue_storage_nodes_connection_never_reaches_the_vm(rogue: tuple[Services, subprocess.Popen[bytes]]) -> None:
    svc, _vm = rogue
    vol = svc.vbs.create_volume(size_gib=1)["volume_id"]
    svc.vbs.wait_volume(vol, "available")
    r = svc.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert r.status_code == 200, r.text
    # The attach fails at the controller, rolls back, and leaves the volume as it was.
    volume = wait_until(lambda: (v := svc.vbs.volume(vol))["status"] == "available"
                        and not any(a["state"] in ("attaching", "attached") for a in v["attachments"]) and v,
                        60, what="attach rolled back")
    assert volume["status"] == "available"
    host = next(h for h in svc.vbs.http.get("/v1/hosts").json()["hosts"] if h["name"] == "host-1")
    disks = httpx.get(f"{host['url']}/v1/vms/vm1/disks",
                      headers={"authorization": f"Bearer {node_token(svc.data_dir, 'host', 'host-1')}"}).json()
    assert [d for d in disks["disks"] if d["serial"] == ids.virtio_serial(vol)] == []
    ops = svc.vbs.http.get(f"/v1/volumes/{vol}").json()
    assert ops["status"] == "available"


def test_the_host_agent_refuses_a_raw_path_even_from_its_controller(tmp_path: Path) -> None:
    svc = Services(tmp_path)
    vm: subprocess.Popen[bytes] | None = None
    try:
        svc.start_controller()
        vm_dir = svc.start_host_agent("host-1")
        vm = start_bare_vm(vm_dir, "vm1", tmp_path / "vm1.log")
        host = next(h for h in svc.vbs.http.get("/v1/hosts").json()["hosts"] if h["name"] == "host-1")
        auth = {"authorization": f"Bearer {node_token(svc.data_dir, 'host', 'host-1')}"}
        wait_until(lambda: httpx.get(f"{host['url']}/v1/vms", headers=auth).json()["vms"], 30, what="vm1 seen")
        serial = ids.virtio_serial("vol-0123456789abcdef0")
        r = httpx.put(f"{host['url']}/v1/vms/vm1/disks/{serial}", headers=auth,
                      json={"connection": {"protocol": "file", "path": "/etc/shadow"}})
        assert r.status_code == 400, r.text
        assert httpx.get(f"{host['url']}/v1/vms/vm1/disks", headers=auth).json()["disks"] == []
    finally:
        if vm is not None:
            stop_bare_vm(vm)
        svc.stop()
