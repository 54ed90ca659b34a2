"""The profile engine: profiles are checked in full at load (naming file and line), values are checked
before anything runs, commands run as argv lists with timeouts and keep their output on failure."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vbs.errors import InvalidParameter
from vbs.profiles import CommandFailed, CommandSchema, ProfileError, ProfileSchema, load_profile

pytestmark = pytest.mark.unit

SCHEMA = ProfileSchema(
    kind="hypervisor",
    commands={
        "attach": CommandSchema(frozenset({"vm", "path", "target", "serial"})),
        "list_vms": CommandSchema(frozenset(), required=False),
    },
    options={"connection": (r"path|nbd", "path")},
)

GOOD = """\
[profile]
kind = "hypervisor"
description = "a test platform"
timeout = 5

[settings]
uri = "qemu:///system"

[commands.attach]
argv = ["{python}", "-c", "import sys; print(sys.argv[1:])", "--connect", "{uri}", "{vm}", "{path}",
        "target={target}"]
expect = "{serial}"

[commands.list_vms]
argv = ["{python}", "-c", "print('NAME'); print(' vm-a '); print(' vm-b ')"]
lines = '^\\s*(?P<vm>vm-[a-z])\\s*$'
"""


def write(tmp_path: Path, text: str, name: str = "plat") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace("{python}", sys.executable))
    return path


def test_a_good_profile_renders_argv_lists_and_runs_them(tmp_path: Path) -> None:
    prof = load_profile(SCHEMA, str(write(tmp_path, GOOD)))
    assert prof.options == {"connection": "path"}
    values = {"vm": "web-1", "path": "/run/vbs/disk", "target": "vdb", "serial": "vol0123456789abcdef0"}
    [argv] = prof.render("attach", values)
    assert argv[3:] == ["--connect", "qemu:///system", "web-1", "/run/vbs/disk", "target=vdb"]
    # The command's output does not hold the serial: expect fails, and the output is in the message.
    with pytest.raises(CommandFailed) as err:
        prof.run("attach", values)
    assert "does not show 'vol0123456789abcdef0'" in err.value.message
    assert "web-1" in err.value.message
    out = prof.run("list_vms", {})
    assert [m["vm"] for m in out.matches(prof.commands["list_vms"])] == ["vm-a", "vm-b"]


@pytest.mark.parametrize("hostile", [
    "a b", "a'b", 'a"b', "a;b", "$(reboot)", "`id`", "a,b\n", "a\nb", "../etc", "-rf", "a|b", "a&b", "",
])
def test_hostile_values_are_refused_before_anything_runs(tmp_path: Path, hostile: str) -> None:
    marker = tmp_path / "ran"
    text = GOOD.replace('"import sys; print(sys.argv[1:])"', f'"open({str(marker)!r}, \'w\')"')
    prof = load_profile(SCHEMA, str(write(tmp_path, text)))
    # A dash is harmless inside a path ("/run/-rf"), not at the start of a value.
    for key in ("vm", "target") if hostile == "-rf" else ("vm", "path", "target"):
        values = {"vm": "web-1", "path": "/run/vbs/disk", "target": "vdb", "serial": "vol0123456789abcdef0"}
        values[key] = hostile if key != "path" else f"/run/{hostile}"
        with pytest.raises(InvalidParameter):
            prof.run("attach", values)
    assert not marker.exists()


def test_a_profile_can_reject_more_characters_for_its_tool(tmp_path: Path) -> None:
    prof = load_profile(SCHEMA, str(write(tmp_path, GOOD.replace("timeout = 5", 'timeout = 5\nreject = "="'))))
    with pytest.raises(InvalidParameter, match="'='"):
        prof.render("attach", {"vm": "web-1", "path": "/run/a=b", "target": "vdb", "serial": "vol0123456789abcdef0"})


@pytest.mark.parametrize(("change", "message", "line"), [
    (("{target}", "{device}"), "unknown placeholder {device}", 11),
    (('kind = "hypervisor"', 'kind = "backend"'), "kind must be 'hypervisor'", 2),
    (("[commands.attach]", "[commands.atach]"), "unknown command 'atach'", 9),
    (('expect = "{serial}"', 'expect = "{serial}"\nretries = 3'), "unknown key 'retries'", 13),
    (('uri = "qemu:///system"', 'uri = "qemu:///system; reboot"'), "setting 'uri'", 7),
    (("timeout = 5", "timeout = -1"), "timeout must be a number", 4),
    (("{vm}", "{vm!r}"), "is not a placeholder", 10),
    (("{vm}", "{vm.__class__}"), "is not a placeholder", 10),
    (('argv = ["{python}", "-c"', 'argv = ["{python}", "-c"'), None, None),
])
def test_a_bad_profile_is_refused_at_load_naming_the_line(tmp_path: Path, change: tuple[str, str],
                                                          message: str | None, line: int | None) -> None:
    path = write(tmp_path, GOOD.replace(*change))
    if message is None:
        load_profile(SCHEMA, str(path))
        return
    with pytest.raises(ProfileError) as err:
        load_profile(SCHEMA, str(path))
    assert message in err.value.message
    assert f"{path}, line {line}" in err.value.message


def test_a_shell_line_is_not_an_argv(tmp_path: Path) -> None:
    text = GOOD.replace('[commands.list_vms]\nargv = [', '[commands.list_vms]\nargv = "sh -c x"\nold = [')
    with pytest.raises(ProfileError, match="never a shell line|unknown key"):
        load_profile(SCHEMA, str(write(tmp_path, text)))


def test_a_missing_required_command_is_named(tmp_path: Path) -> None:
    text = GOOD.split("[commands.attach]")[0] + GOOD.split('expect = "{serial}"\n')[1]
    with pytest.raises(ProfileError, match="the command 'attach' is missing"):
        load_profile(SCHEMA, str(write(tmp_path, text)))


def test_profiles_are_found_by_name_in_the_operators_directory(tmp_path: Path) -> None:
    (tmp_path / "hypervisor").mkdir()
    write(tmp_path / "hypervisor", GOOD, "mycloud")
    prof = load_profile(SCHEMA, "mycloud", [tmp_path])
    assert prof.name == "mycloud" and prof.description == "a test platform"
    with pytest.raises(ProfileError, match="no hypervisor profile named 'other'"):
        load_profile(SCHEMA, "other", [tmp_path])
    with pytest.raises(ProfileError, match="invalid profile name"):
        load_profile(SCHEMA, "UP;rm", [tmp_path])


def test_a_timeout_fails_the_command_with_a_reason(tmp_path: Path) -> None:
    text = GOOD.replace("print('NAME'); print(' vm-a '); print(' vm-b ')", "import time; time.sleep(5)") \
        .replace("lines = ", "timeout = 0.2\nlines = ")
    prof = load_profile(SCHEMA, str(write(tmp_path, text)))
    with pytest.raises(CommandFailed, match="no answer within 0.2s"):
        prof.run("list_vms", {})


def test_children_get_no_secret_from_the_agents_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VBS_AGENT_TOKEN", "s3cret")
    text = GOOD.replace("print('NAME'); print(' vm-a '); print(' vm-b ')", "import os; print(sorted(os.environ))")
    prof = load_profile(SCHEMA, str(write(tmp_path, text)))
    out = prof.run("list_vms", {})
    assert "VBS_AGENT_TOKEN" not in out.stdout and "PATH" in out.stdout
    assert os.environ["VBS_AGENT_TOKEN"] == "s3cret"


def test_argument_groups_are_given_only_with_their_value(tmp_path: Path) -> None:
    group = '{ when = "serial", args = ["--serial", "{serial}"] }'
    text = GOOD.replace('"target={target}"]', f'"target={{target}}", {group}]')
    prof = load_profile(SCHEMA, str(write(tmp_path, text)))
    values = {"vm": "web-1", "path": "/run/vbs/disk", "target": "vdb", "serial": "vol0123456789abcdef0"}
    assert prof.render("attach", values)[0][-2:] == ["--serial", "vol0123456789abcdef0"]
    del values["serial"]
    assert prof.render("attach", values)[0][-1] == "target=vdb"
    bad = GOOD.replace('"target={target}"]', '"target={target}", { when = "nosuch", args = ["x"] }]')
    with pytest.raises(ProfileError, match="unknown placeholder 'nosuch'"):
        load_profile(SCHEMA, str(write(tmp_path, bad)))
