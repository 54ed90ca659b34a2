"""Instance-id resolvers: a cloud's id maps to (host, VM) through the configured plug-in, each id is
checked against its resolver's own pattern before anything runs, and a broken configuration stops
the controller at start with the reason."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from vbs.config import ControllerConfig
from vbs.controller.db import Database
from vbs.controller.fleet.nodes import record_host_heartbeat
from vbs.controller.resolvers import Location, Resolvers
from vbs.errors import InvalidParameter, NotFound
from vbs.profiles import ProfileError
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities, VmInfo

pytestmark = pytest.mark.unit

NOVA_UUID = "2f1c8e4a-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
HOSTILE = ["a b", "a'b", 'a"b', "a;b", "$(reboot)", "`id`", "a,b", "a\nb", "../etc", "-rf", ""]


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = Database.for_data_dir(tmp_path)
    db.migrate()
    with db.session() as s:
        record_host_heartbeat(s, HostHeartbeat(
            name="hv-1", url="http://127.0.0.1:1", address="127.0.0.1", hypervisor="libvirt",
            capabilities=HypervisorCapabilities(protocols=["nbd"]), started_at=datetime.now(UTC),
            vms=[VmInfo(vm_id="instance-0000002a", name="web", running=True, cloud_ids={"nova": NOVA_UUID}),
                 VmInfo(vm_id="plain", running=True)]))
    return db


def lab_profile(tmp_path: Path, answers: dict[str, str] | None = None, *,
                lines: str = r'^(?P<host>[a-z0-9.-]+) (?P<vm>[A-Za-z0-9._-]+)$') -> Path:
    """A resolver profile whose command is a script printing ``answers[id]`` (``HOST VM``) after a
    header line, or nothing for an unknown id; every id it is run with is appended to ``ran``."""
    answers = {"lab-1": "hv-1 plain"} if answers is None else answers
    script = tmp_path / "lab-lookup"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      f"open({str(tmp_path / 'ran')!r}, 'a').write(sys.argv[1] + '\\n')\n"
                      "print('# lab inventory')\n"
                      f"print({answers!r}.get(sys.argv[1], ''))\n")
    script.chmod(0o700)
    path = tmp_path / "lab.toml"
    path.write_text(f"""\
[profile]
kind = "resolver"
description = "the lab's inventory script"

[placeholders]
id = "lab-[0-9]{{1,6}}"

[commands.resolve]
argv = ["{script}", "{{id}}"]
lines = '{lines}'
""")
    return path


def resolvers(tmp_path: Path, **extra: str) -> Resolvers:
    return Resolvers.from_config(ControllerConfig(data_dir=tmp_path, resolvers={"nova": "libvirt-metadata", **extra}))


def test_nova_ids_are_found_in_what_host_agents_report(db: Database, tmp_path: Path) -> None:
    r = resolvers(tmp_path)
    assert r.locate(db, f"nova:{NOVA_UUID}") == Location("hv-1", "instance-0000002a")
    with pytest.raises(NotFound) as err:
        r.locate(db, "nova:00000000-0000-4000-8000-000000000000")
    assert err.value.code == "InvalidInstanceID.NotFound"
    for bad in ["nova:2F1C8E4A-5B6D-4E7F-8A9B-0C1D2E3F4A5B", "nova:instance-0000002a", *(f"nova:{h}" for h in HOSTILE)]:
        with pytest.raises(InvalidParameter) as bad_err:
            r.locate(db, bad)
        assert bad_err.value.code == "InvalidInstanceID.Malformed"
    with pytest.raises(InvalidParameter, match="Unknown instance id scheme 'aws'"):
        r.locate(db, "aws:i-0123")


def test_a_command_resolver_maps_ids_through_its_script(db: Database, tmp_path: Path) -> None:
    r = resolvers(tmp_path, lab=f"command:{lab_profile(tmp_path)}")
    assert r.locate(db, "lab:lab-1") == Location("hv-1", "plain")
    with pytest.raises(NotFound):
        r.locate(db, "lab:lab-2")
    assert (tmp_path / "ran").read_text() == "lab-1\nlab-2\n"
    for hostile in HOSTILE + ["lab-1 x", "lab-1;id", "lab-1\n"]:
        with pytest.raises(InvalidParameter):
            r.locate(db, f"lab:{hostile}")
    assert (tmp_path / "ran").read_text() == "lab-1\nlab-2\n", "no hostile id reached the script"


def test_a_resolver_answering_a_bad_location_is_an_error(db: Database, tmp_path: Path) -> None:
    profile = lab_profile(tmp_path, lines=r'^(?P<host>.*) (?P<vm>.*)$')
    r = resolvers(tmp_path, lab=f"command:{profile}")
    with pytest.raises(Exception, match="invalid location"):
        r.locate(db, "lab:lab-7")  # prints "# lab inventory": host "#", vm "lab inventory"


@pytest.mark.parametrize(("setting", "message"), [
    ({"nova": "nosuch"}, "no resolver driver named 'nosuch'"),
    ({"Nova": "libvirt-metadata"}, "expecting SCHEME"),
    ({"lab": "command"}, "names its profile"),
    ({"lab": "command:missing"}, "no resolver profile named 'missing'"),
    ({"nova": "libvirt-metadata:x"}, "takes no argument"),
])
def test_a_broken_configuration_stops_the_controller_with_the_reason(tmp_path: Path, setting: dict[str, str],
                                                                     message: str) -> None:
    with pytest.raises((InvalidParameter, ProfileError), match=message):
        Resolvers.from_config(ControllerConfig(data_dir=tmp_path, resolvers=setting,
                                               resolver_profile_dirs=[tmp_path]))
