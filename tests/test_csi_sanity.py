"""The upstream csi-sanity suite (kubernetes-csi/csi-test, built at set-up by scripts/csi-toolchain) against
``vbs csi`` on a real ``vbs up`` whose host agent is a Kubernetes node (the csi-node hypervisor profile),
with real loop devices, filesystems and mounts: every test passes, and every test it skips is one of a
capability the driver does not advertise (docs/kubernetes.md "Proof"). The driver calls VBS with a
``user`` key of its own tenant, read from a 0600 file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import VBS, Vbs, VbsUp, stop_process, wait_until
from vbs.csi import proto
from vbs.system.files import write_private

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SANITY = ROOT / ".tools" / "bin" / "csi-sanity"
PROFILE = ROOT / "src" / "vbs" / "profiles" / "hypervisor" / "csi-node.toml"
ZONE = "us-east-1a"  # vbs up's one storage node's
NODE = "host-1"  # vbs up's host agent

# What csi-sanity says when it skips a test, and the capability whose absence it names: the driver must
# not advertise any of them (a skip for an advertised capability would hide a failure).
SKIP_REASONS = {
    "NodeExpandVolume not supported": ("node", "EXPAND_VOLUME"),
    "GetCapacity not supported": ("controller", "GET_CAPACITY"),
    "Modify volume not supported": ("controller", "MODIFY_VOLUME"),
    "Modify Volume not supported": ("controller", "MODIFY_VOLUME"),
    "ControllerModifyVolume not supported": ("controller", "MODIFY_VOLUME"),
    "GroupControllerService not supported": ("plugin", "GROUP_CONTROLLER_SERVICE"),
    # Not a capability: a test of csi-sanity's own option (--csi.testnodevolumeattachlimit), which would
    # publish max_volumes_per_node + 1 (651) volumes.
    "testnodevolumeattachlimit not enabled": ("option", ""),
}


@dataclass
class CsiRig:
    vbs: Vbs
    tmp: Path
    socket: Path
    disks: Path
    proc: subprocess.Popen[bytes]
    user_key: str  # the driver's bearer token

    argv: list[str]
    log: Path

    def restart(self) -> None:
        """Stop the driver (SIGTERM) and start it again on the same socket."""
        stop_process(self.proc)
        self.proc = _start_driver(self.argv, self.socket, self.log)

    def capabilities(self) -> dict[str, set[str]]:
        """What the running driver advertises, asked over gRPC as the sidecars ask."""
        import grpc

        pb, services = proto.pb(), proto.pb_grpc()
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            plugin = services.IdentityStub(channel).GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
            controller = services.ControllerStub(channel).ControllerGetCapabilities(
                pb.ControllerGetCapabilitiesRequest())
            node = services.NodeStub(channel).NodeGetCapabilities(pb.NodeGetCapabilitiesRequest())
        return {
            "plugin": {pb.PluginCapability.Service.Type.Name(c.service.type) for c in plugin.capabilities
                       if c.HasField("service")},
            "controller": {pb.ControllerServiceCapability.RPC.Type.Name(c.rpc.type) for c in controller.capabilities},
            "node": {pb.NodeServiceCapability.RPC.Type.Name(c.rpc.type) for c in node.capabilities},
        }


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CsiRig]:
    assert SANITY.is_file(), f"{SANITY} is missing: make setup builds it (scripts/csi-toolchain)"
    tmp = tmp_path_factory.mktemp("csi")
    disks = tmp / "disks"
    profile = tmp / "csi-node.toml"
    profile.write_text(PROFILE.read_text().replace('dir = "/run/vbs-csi/disks"', f'dir = "{disks}"'))
    up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=["--hypervisor", "command", "--hypervisor-profile", str(profile)])
    rig = None
    try:
        vbs = up.start()
        answer = vbs.http.post("/v1/keys", json={"tenant": "k8s", "role": "user"})
        assert answer.status_code == 200, answer.text
        key = answer.json()
        creds = tmp / "credentials"
        write_private(creds, f"[default]\naws_access_key_id = {key['access_key_id']}\n"
                             f"aws_secret_access_key = {key['secret_access_key']}\n")
        wait_until(lambda: any(i["vm_id"] == "csi-node" for i in vbs.http.get("/v1/instances").json()["instances"]),
                   60, what="the node's pseudo-VM")
        plugin = tmp / "plugin" / "csi.sock"
        argv = [*VBS, "csi", "--endpoint", f"unix://{plugin}", "--controller-url", vbs.endpoint,
                "--credentials-file", str(creds), "--node-id", NODE, "--zone", ZONE, "--disk-dir", str(disks)]
        proc = _start_driver(argv, plugin, tmp / "csi.log")
        rig = CsiRig(vbs, tmp, plugin, disks, proc, f"{key['access_key_id']}:{key['secret_access_key']}", argv,
                     tmp / "csi.log")
        yield rig
    finally:
        if rig is not None:
            stop_process(rig.proc)
        release_node(tmp)
        up.stop()


def _start_driver(argv: list[str], plugin: Path, log: Path) -> subprocess.Popen[bytes]:
    """``vbs csi``, once its socket accepts connections (it exists a moment before it does)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    wait_until(lambda: accepts(plugin) or proc.poll() is not None, 60, what="the CSI socket")
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc


def accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _loops_under(root: Path) -> list[str]:
    """The loop devices whose file lies under ``root`` (the volumes' FUSE files of this test's install)."""
    listed = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True, check=True).stdout
    return [d["name"] for d in json.loads(listed or '{"loopdevices": []}')["loopdevices"]
            if (d.get("back-file") or "").startswith(f"{root}/")]


def release_node(tmp: Path) -> None:
    """After a failed test: what the node still holds of this test's volumes, let go (mounts, then loops)."""
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(f"{tmp}/") and "/var/host-state/" not in point:
            subprocess.run(["umount", "--lazy", point], check=False)
    for device in _loops_under(tmp):
        subprocess.run(["losetup", "--detach", device], check=False)


def run_sanity(rig: CsiRig, name: str, *extra: str) -> tuple[Counter[str], dict[str, int], str]:
    """Run csi-sanity; the tally of its JUnit report (run, passed, failed, skipped), its skips by
    reason, and its output's tail."""
    junit = rig.tmp / f"{name}.xml"
    # csi-sanity makes its staging and mount directories itself (in this one) and removes them.
    work = rig.tmp / name
    work.mkdir()
    proc = subprocess.run([str(SANITY), f"--csi.endpoint=unix://{rig.socket}",
                           f"--csi.stagingdir={work / 'staging'}", f"--csi.mountdir={work / 'mount'}",
                           f"--csi.testvolumesize={1 << 30}", f"--csi.testvolumeexpandsize={2 << 30}",
                           f"--ginkgo.junit-report={junit}", "--ginkgo.no-color", *extra],
                          capture_output=True, text=True, timeout=1800)
    tally: Counter[str] = Counter()
    skips: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            tally["failed"] += 1
        elif skipped is not None:
            message = (skipped.get("message") or "").removeprefix("skipped - ").strip()
            tally["pending" if message == "pending" else "skipped"] += 1
            if message != "pending":
                skips[message] += 1
        else:
            tally["passed"] += 1
    tally["run"] = tally["passed"] + tally["failed"]
    assert proc.returncode == 0 or tally["failed"], proc.stdout[-3000:]
    return tally, dict(skips), proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("access_type", ["mount", "block"])
def test_csi_sanity_passes_every_test_of_every_advertised_capability(rig: CsiRig, access_type: str) -> None:
    tally, skips, output = run_sanity(rig, access_type, f"--csi.testvolumeaccesstype={access_type}")
    print(f"csi-sanity ({access_type}): {json.dumps(dict(tally))}; skipped by reason: {json.dumps(skips)}")
    assert tally["failed"] == 0, output
    assert tally["passed"] >= 70, (tally, output)  # the suite ran whole, not an empty focus
    advertised = rig.capabilities()
    for reason in skips:
        assert reason in SKIP_REASONS, f"csi-sanity skipped tests for a reason not accounted for: {reason!r}"
        service, capability = SKIP_REASONS[reason]
        if service != "option":
            assert capability not in advertised[service], f"{capability} is advertised, yet skipped: {reason}"
    # Nothing is left behind on the node (no volume published, looped or mounted) nor in VBS (no volume
    # or snapshot of the driver's tenant: clones' intermediate snapshots went too).
    assert not rig.disks.exists() or os.listdir(rig.disks) == []
    assert _loops_under(rig.tmp) == []
    assert str(rig.tmp / access_type) not in Path("/proc/self/mountinfo").read_text()
    for collection in ("volumes", "snapshots"):
        answer = rig.vbs.http.get(f"/v1/{collection}", headers={"authorization": f"Bearer {rig.user_key}"})
        assert answer.status_code == 200, answer.text
        assert [item for item in answer.json()[collection] if item["status"] != "deleted"] == [], collection
