"""Every shipped profile (hypervisor and backend): it loads, renders exactly the argv its documentation shows
(golden files, one argument per line; ``VBS_UPDATE_GOLDEN=1`` rewrites them, and the diff is then
reviewed like code), and refuses hostile values for every placeholder before anything runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vbs.errors import InvalidParameter
from vbs.host.hypervisors.command import HYPERVISOR_PROFILES
from vbs.profiles import Profile, ProfileSchema, load_profile, shipped_profiles
from vbs.storage.backends.command import BACKEND_PROFILES

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden" / "profiles"
SCHEMAS: dict[str, ProfileSchema] = {"hypervisor": HYPERVISOR_PROFILES, "backend": BACKEND_PROFILES}
SHIPPED = shipped_profiles("hypervisor")
ALL = [("hypervisor", n) for n in SHIPPED] + [("backend", n) for n in shipped_profiles("backend")]

# Sample parameters, as the driver would give them for a third disk on a VM.
SAMPLE: dict[str, object] = {
    "vm": "web-1", "serial": "vol0123456789abcdef0", "volume": "vol-0123456789abcdef0", "target": "vdc",
    "index": 2, "access": "rw", "path": "/var/lib/vbs/host/local-paths/vol0123456789abcdef0/disk",
    "nbd_host": "192.0.2.10", "nbd_port": 10809, "nbd_export": "vol-0123456789abcdef0",
    "nbd_uri": "nbd://192.0.2.10:10809/vol-0123456789abcdef0",
    "nbd_socket": "/run/vbs/storage/nbd.sock",
    # a backend's
    "snapshot": "snap-0fedcba9876543210", "source_snapshot": "snap-0fedcba9876543210",
    "snapshot_path": "/var/lib/vbs/pool/snapshots/snap-0fedcba9876543210.qcow2", "pool_path": "/var/lib/vbs/pool",
    "size_bytes": 10737418240, "size_mib": 10240, "format": "qcow2",
}
HOSTILE = ["a b", "a'b", 'a"b', "a;b", "$(reboot)", "`id`", "a,b", "a\nb", "../etc/passwd", "x/../y", "-oProxy",
           "a|b", "a&b", "a>b", ""]


def test_the_shipped_profiles_are_the_documented_ones() -> None:
    assert SHIPPED == ["csi-node", "proxmox", "qemu-monitor", "virsh", "virsh-path", "xen"]
    assert shipped_profiles("backend") == ["lvm", "qemu-img"]


def _sample_for(profile: Profile) -> dict[str, object]:
    sample = dict(SAMPLE)
    if profile.kind == "backend":
        sample["path"] = "/var/lib/vbs/pool/volumes/vol-0123456789abcdef0.qcow2"
    if profile.options.get("target_prefix") == "xvd":
        sample["target"] = "xvdc"
    if profile.name == "proxmox":
        sample["vm"] = "104"
    return sample


@pytest.mark.parametrize(("kind", "name"), ALL)
def test_each_command_renders_as_its_golden_file(kind: str, name: str) -> None:
    profile = load_profile(SCHEMAS[kind], name, [])
    if kind == "hypervisor":
        assert {"list_vms", "attach", "detach", "verify"} <= set(profile.commands), "every shipped one has them"
    for command in sorted(profile.commands):
        argvs = profile.render(command, _sample_for(profile))
        text = "\n---\n".join("\n".join(argv) for argv in argvs) + "\n"
        golden = GOLDEN / f"{'' if kind == 'hypervisor' else 'backend-'}{name}-{command}.argv"
        if os.environ.get("VBS_UPDATE_GOLDEN") == "1":
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.read_text() == text, f"{name} {command} renders differently from {golden}"


@pytest.mark.parametrize(("kind", "name"), ALL)
def test_hostile_values_are_refused_for_every_placeholder_before_anything_runs(kind: str, name: str,
                                                                              tmp_path: Path) -> None:
    shipped = load_profile(SCHEMAS[kind], name, [])
    # The same profile whose every program is a script that leaves a mark if it ever runs.
    marker = tmp_path / "ran"
    script = tmp_path / "tool"
    script.write_text(f"#!{sys.executable}\nopen({str(marker)!r}, 'a').write('ran')\n")
    script.chmod(0o700)
    text = shipped.path.read_text()
    programs = {spec.argv[0] for spec in shipped.commands.values()}
    programs |= {spec.then[0] for spec in shipped.commands.values() if spec.then}
    for program in programs:
        text = text.replace(f'["{program}"', f'["{script}"').replace(f'= ["{program}",', f'= ["{script}",')
    armed_path = tmp_path / f"{name}.toml"
    armed_path.write_text(text)
    armed = load_profile(SCHEMAS[kind], str(armed_path))
    sample = _sample_for(armed)
    for command, spec in armed.commands.items():
        assert spec.argv[0] == str(script)
        used = {f for f in spec.fields if f in sample}
        for field in used:
            for hostile in HOSTILE:
                bad = dict(sample)
                bad[field] = hostile  # a string where an integer belongs is refused too
                if isinstance(sample[field], str) and str(sample[field]).startswith("/") and hostile:
                    if hostile.startswith("-"):
                        continue  # "/var/lib/-o" is a harmless path: a dash only matters first
                    bad[field] = f"/var/lib/{hostile}"  # inside an absolute path, too
                with pytest.raises(InvalidParameter, match="."):
                    armed.run(command, bad)
        armed.run(command, sample) if command != "verify" else armed.probe(command, sample)
    assert marker.exists(), "the armed profile runs with good values"
    marker.unlink()
    assert not marker.exists()


def test_integer_placeholders_are_bounded() -> None:
    profile = load_profile(HYPERVISOR_PROFILES, "proxmox", [])
    for bad in (-1, 256, True, "2"):
        with pytest.raises(InvalidParameter):
            profile.render("attach", {**_sample_for(profile), "index": bad})


def test_only_path_profiles_open_luks_and_may_grow_disks_online_and_of_the_shipped_ones_only_csi_node_grows(
        tmp_path: Path) -> None:
    from vbs.host.hypervisors.command import CommandDriver

    drivers = {name: CommandDriver(load_profile(HYPERVISOR_PROFILES, name, []), tmp_path / name) for name in SHIPPED}
    growing = {name for name, driver in drivers.items() if driver.capabilities.online_resize}
    assert growing == {"csi-node"}
    decrypting = {name for name, driver in drivers.items() if driver.capabilities.luks}
    assert decrypting == {name for name, driver in drivers.items() if driver.form == "path"}  # the host opens LUKS
    assert "virsh" not in decrypting  # an nbd profile's tool would be handed ciphertext
    nbd = tmp_path / "grow-nbd.toml"
    nbd.write_text('[profile]\nkind = "hypervisor"\nconnection = "nbd"\nonline_resize = "true"\n'
                   '[commands.list_vms]\nargv = ["echo", "vm"]\n[commands.attach]\nargv = ["true", "{nbd_uri}"]\n'
                   '[commands.detach]\nargv = ["true"]\n[commands.verify]\nargv = ["true"]\n')
    with pytest.raises(InvalidParameter, match="online_resize needs"):
        CommandDriver(load_profile(HYPERVISOR_PROFILES, str(nbd), []), tmp_path / "nbd")
