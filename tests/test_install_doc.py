"""docs/install.md holds real commands only: every ``vbs`` command of its shell blocks exists with the
options it is given, every configuration it writes is one the services accept, and every unit it
installs is in deploy/systemd. (tests/test_install.py runs the same install on one machine; running the
page word for word on several is the namespace cluster's test.)"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tests.test_cli_doc import commands, flags
from vbs import config
from vbs.cli.argv_hoisting import _GLOBAL_FLAGS, _GLOBAL_VALUED, hoist_global_options

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "install.md"
GLOBAL = {*_GLOBAL_VALUED, *_GLOBAL_FLAGS, "--version"}
# Where a vbs command starts on a line: at its start, after `runuser -u vbs --`, or in `$( … )`.
VBS_CALL = re.compile(r"(?:^|\$\(|-- )vbs((?: [^)|>]*)?)")
SECTIONS = {"controller": config.ControllerConfig, "storage_agent": config.StorageAgentConfig,
            "host_agent": config.HostAgentConfig}


def shell_blocks() -> list[str]:
    text = DOC.read_text()
    blocks = re.findall(r"^```(?:sh|console)\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) > 15
    return blocks


def example_values() -> dict[str, str]:
    """The values the page's `# per machine` blocks give, first of each name (enough for the checks)."""
    values: dict[str, str] = {}
    for block in shell_blocks():
        if block.startswith("# per "):
            for name, value in re.findall(r"^([A-Z0-9_]+)=(.*)$", block, flags=re.M):
                values.setdefault(name, value.strip("'"))
    assert {"NAME", "ADDR", "CTL1", "CONTROLLERS", "DB", "BUILD"} <= set(values)
    return values


def test_every_vbs_command_exists_with_the_options_it_is_given() -> None:
    known = commands()
    seen: set[str] = set()
    for block in shell_blocks():
        for line in block.splitlines():
            if line.lstrip().startswith("#"):
                continue
            for match in VBS_CALL.finditer(line):
                argv = hoist_global_options(shlex.split(match.group(1)))
                words = [a for a in argv if not a.startswith("-")]
                name = next((f"{a} {b}" for a, b in zip(words, words[1:], strict=False) if f"{a} {b}" in known),
                            next((w for w in words if w in known), None))
                if name is None:
                    assert argv in (["--version"],), f"not a vbs command: {line}"
                    continue
                seen.add(name)
                allowed = flags(known[name]) | GLOBAL
                given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
                assert given <= allowed, f"{line}: {sorted(given - allowed)} is no option of vbs {name}"
    assert {"bootstrap-key", "issue-cert", "node-token", "db upgrade", "db status", "create-volume",
            "describe-storage-nodes", "describe-hosts", "attach-volume", "delete-volume"} <= seen


def test_every_configuration_it_writes_is_one_the_services_accept() -> None:
    values = example_values()
    written = 0
    for block in shell_blocks():
        for body in re.findall(r"^cat > /etc/vbs/vbs\.toml <<EOF\n(.*?)^EOF$", block, flags=re.S | re.M):
            text = re.sub(r"\$([A-Z0-9_]+)", lambda m: values[m.group(1)], body)
            document = tomllib.loads(text)
            assert document and set(document) <= set(SECTIONS), document
            for section, keys in document.items():
                SECTIONS[section].model_validate(keys)  # unknown keys and bad values are refused
                written += 1
    assert written >= 4  # two controllers, a storage node, a hypervisor node


def test_every_unit_it_installs_is_in_the_repository() -> None:
    text = DOC.read_text()
    installed = set(re.findall(r"cp /root/vbs-dist/(vbs-[a-z-]+\.service) /etc/systemd/system/", text))
    assert installed == {p.name for p in (REPO / "deploy" / "systemd").glob("*.service")}
    assert len(installed) == 3
