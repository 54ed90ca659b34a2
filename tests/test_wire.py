"""The typed wire: models both sides import, and errors that keep their class across HTTP (unit tier).

A real HTTP server on loopback (the host agent's own app, in this process) stands between the
caller and a driver that raises; no agent process, daemon or VM is needed to prove the wire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import SecretStr, ValidationError

from tests.conftest import free_port
from vbs.controller.fleet.agents import HostAgent
from vbs.errors import DeviceBusy, DriverError, IncorrectState, NotFound, VbsError, from_body
from vbs.host.api import create_app
from vbs.net.web import ApiClient, agent_auth
from vbs.trust.node_credentials import TokenSource
from vbs.wire.connection import IscsiConnection, NbdConnection
from vbs.wire.host import DiskInfo, HypervisorCapabilities, QoS, VmInfo
from vbs.wire.storage import EnsureVolume, ItemStatus

pytestmark = pytest.mark.unit

SERIAL = "vol0123456789abcdef0"


class PluginError(DriverError):
    """An error class a third-party driver defines: it must cross the wire as itself too."""

    code = "PluginTrouble"


class RaisingDriver:
    """A hypervisor driver whose every call fails the way the test asks."""

    capabilities = HypervisorCapabilities(protocols=["nbd"], online_resize=True)

    def __init__(self) -> None:
        self.error: Exception = DeviceBusy("guest of VM vm1 did not release disk", vm_id="vm1", serial=SERIAL)
        self.attached: list[tuple[str, str, Any]] = []

    def list_vms(self) -> list[VmInfo]:
        return [VmInfo(vm_id="vm1", name="one", running=True)]

    def attach(self, vm_id: str, serial: str, connection: Any, *, read_only: bool = False,
               qos: QoS | None = None, luks: Any = None) -> DiskInfo:
        self.attached.append((vm_id, serial, connection))
        return DiskInfo(serial=serial, read_only=read_only)

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        raise self.error


@pytest.fixture
def host_agent() -> Iterator[tuple[HostAgent, RaisingDriver]]:
    driver = RaisingDriver()
    port = free_port()
    app = create_app(driver, agent_auth(TokenSource("t0ken"), insecure=False), "host-1")  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    client = ApiClient(f"http://127.0.0.1:{port}", "t0ken")
    try:
        yield HostAgent(client), driver
    finally:
        client.close()
        server.should_exit = True
        thread.join(10)


def test_a_typed_agent_error_arrives_as_its_class_with_its_fields(host_agent: tuple[HostAgent, RaisingDriver]) -> None:
    agent, _ = host_agent
    with pytest.raises(DeviceBusy) as err:
        agent.detach("vm1", SERIAL, force=False, timeout=1)
    assert isinstance(err.value, IncorrectState)
    assert err.value.code == "DeviceBusy" and err.value.status == 409
    assert err.value.fields == {"vm_id": "vm1", "serial": SERIAL}
    assert "did not release" in err.value.message


def test_an_error_class_of_a_plugin_arrives_as_itself_and_unknown_ones_keep_code_and_status(
        host_agent: tuple[HostAgent, RaisingDriver]) -> None:
    agent, driver = host_agent
    driver.error = PluginError("the plug-in's tool failed")
    with pytest.raises(PluginError) as err:
        agent.detach("vm1", SERIAL, force=True, timeout=1)
    assert err.value.code == "PluginTrouble" and err.value.status == 502

    unknown = from_body({"code": "Odd", "message": "from a newer agent", "type": "NoSuchClass"}, 418)
    assert type(unknown) is VbsError and (unknown.code, unknown.status) == ("Odd", 418)


def test_requests_are_validated_on_the_agents_side(host_agent: tuple[HostAgent, RaisingDriver]) -> None:
    agent, driver = host_agent
    conn = NbdConnection(host="127.0.0.1", port=10809, export="vol-0123456789abcdef0-x")
    assert agent.attach("vm1", SERIAL, conn, read_only=True, qos=None) == DiskInfo(serial=SERIAL, read_only=True)
    assert driver.attached == [("vm1", SERIAL, conn)]
    with pytest.raises(IncorrectState, match="cannot open iscsi"):
        agent.attach("vm1", SERIAL, IscsiConnection(host="127.0.0.1", port=3260, iqn="iqn.2026-11.org.vbs:x"),
                     read_only=False, qos=None)
    with pytest.raises(NotFound):
        agent._client.request("GET", "/v1/no-such-route", DiskInfo)  # noqa: SLF001


def test_a_wrong_answer_from_an_agent_is_a_clear_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"state": "nonsense"}))
    client = ApiClient("http://agent", None)
    client._http = httpx.Client(base_url="http://agent", transport=transport)  # noqa: SLF001
    with pytest.raises(VbsError, match="invalid ItemStatus") as err:
        client.request("GET", "/v1/pools/p/volumes/vol-0123456789abcdef0", ItemStatus)
    assert err.value.status == 502


def test_wire_models_refuse_what_they_do_not_know_and_hide_secrets() -> None:
    with pytest.raises(ValidationError):
        EnsureVolume.model_validate({"size_bytes": 1024, "source_snapshot_id": "vol-0123456789abcdef0"})
    with pytest.raises(ValidationError):
        EnsureVolume.model_validate({"size_bytes": 1024, "extra": 1})
    conn = IscsiConnection(host="10.0.0.1", port=3260, iqn="iqn.2026-11.org.vbs:vol-0123456789abcdef0",
                           chap_user="u", chap_secret=SecretStr("very-secret-chap"))
    assert "very-secret-chap" not in repr(conn) and "very-secret-chap" not in str(conn.model_dump())
    assert conn.model_dump(mode="json")["chap_secret"] == "very-secret-chap"  # only for the wire


def test_a_host_whose_driver_cannot_mirror_says_so(host_agent: tuple[HostAgent, RaisingDriver]) -> None:
    """A driver without ``capabilities.mirror`` (libvirt, command) refuses to move a disk, with the reason."""
    agent, _ = host_agent
    conn = NbdConnection(host="127.0.0.1", port=10809, export="vol-0123456789abcdef0-x")
    with pytest.raises(IncorrectState, match="cannot move a disk to another storage node"):
        agent.ensure_mirror("vm1", SERIAL, conn, pivot=False)
    agent.remove_mirror("vm1", SERIAL)  # it has none to remove: success, as every removal of nothing
