"""The CLI's AWS habits: global options anywhere on the line, --output table|json|yaml|text,
--query (JMESPath) and --no-paginate — the README's own quick-start line included."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import VBS, Vbs, running_vbs_up
from vbs.cli import output
from vbs.cli.argv_hoisting import hoist_global_options


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "expected"), [
    (["describe-volumes", "--filter", "status=available", "--output", "json"],
     ["--output", "json", "describe-volumes", "--filter", "status=available"]),
    (["describe-volumes", "-o", "yaml", "--query", "volumes[0]", "--no-paginate"],
     ["-o", "yaml", "--query", "volumes[0]", "--no-paginate", "describe-volumes"]),
    (["--endpoint", "http://x", "describe-volumes", "--output=text"],
     ["--endpoint", "http://x", "--output=text", "describe-volumes"]),
    (["create-volume", "--comment", "x", "--", "--output"], ["create-volume", "--comment", "x", "--", "--output"]),
    (["host-agent", "--hypervisor-profile", "virsh", "--output", "json"],
     ["host-agent", "--hypervisor-profile", "virsh", "--output", "json"]),
    ([], []),
])
def test_global_options_move_before_the_command(argv: list[str], expected: list[str]) -> None:
    assert hoist_global_options(argv) == expected


@pytest.mark.unit
def test_text_and_yaml_forms(capsys: pytest.CaptureFixture[str]) -> None:
    body = {"volumes": [{"volume_id": "vol-1", "size_gib": 1, "tags": {"a": "b"}},
                        {"volume_id": "vol-2", "size_gib": 2, "tags": {}}], "next_token": None}
    output.configure("text", None)
    output.emit(body, "text")
    assert capsys.readouterr().out.splitlines() == ["None", "vol-1\t1", "b", "vol-2\t2"]
    output.configure("text", "volumes[].volume_id")
    output.emit(body, "text")
    assert capsys.readouterr().out == "vol-1\tvol-2\n"
    output.configure("yaml", "volumes[?size_gib > `1`]")
    output.emit(body, "yaml")
    assert yaml.safe_load(capsys.readouterr().out) == [body["volumes"][1]]
    with pytest.raises(ValueError, match="--query"):
        output.configure("json", "volumes[?")
    output.configure("json", None)


def run_cli(vbs: Vbs, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VBS_ENDPOINT": vbs.endpoint, "VBS_ACCESS_KEY_ID": vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key}
    return subprocess.run([*VBS, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    with running_vbs_up(tmp_path_factory.mktemp("cli")) as v:
        yield v


@pytest.mark.integration
def test_the_readme_line_and_friends_work_as_typed(vbs: Vbs, tmp_path: Path) -> None:
    made = [vbs.cli("create-volume", "--size", "1", "--tag", "team=db", "--wait")["volume_id"] for _ in range(3)]
    vbs.cli("create-volume", "--size", "1", "--tag", "team=web", "--wait")

    r = run_cli(vbs, "describe-volumes", "--filter", "status=available", "--filter", "tag:team=db", "--output", "json")
    assert r.returncode == 0, r.stderr
    assert sorted(v["volume_id"] for v in json.loads(r.stdout)["volumes"]) == sorted(made)

    r = run_cli(vbs, "describe-volumes", "--filter", "tag:team=db", "--query", "volumes[].volume_id", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)) == sorted(made)

    r = run_cli(vbs, "describe-volumes", "--filter", "tag:team=db", "--output", "yaml")
    doc: Any = yaml.safe_load(r.stdout)
    assert sorted(v["volume_id"] for v in doc["volumes"]) == sorted(made)

    r = run_cli(vbs, "describe-volumes", "--filter", "tag:team=db", "--output", "text", "--query",
                "volumes[].[volume_id, status]")
    assert sorted(r.stdout.splitlines()) == sorted(f"{v}\tavailable" for v in made)

    # --no-paginate: the first page only, and its token.
    r = run_cli(vbs, "describe-volumes", "--no-paginate", "--output", "json", "--filter", "tag:team=db")
    assert len(json.loads(r.stdout)["volumes"]) == 3
    r = run_cli(vbs, "describe-volumes", "--max-results", "5", "--output", "json")
    body = json.loads(r.stdout)
    assert len(body["volumes"]) == 4 and body.get("next_token") is None

    bad = run_cli(vbs, "describe-volumes", "--query", "volumes[?", "--output", "json")
    assert bad.returncode == 2 and "--query" in bad.stderr
    bad = run_cli(vbs, "describe-volumes", "--output", "xml")
    assert bad.returncode == 2 and "--output must be one of" in bad.stderr


@pytest.mark.integration
def test_errors_speak_the_options_typed_and_hints_name_the_command(vbs: Vbs) -> None:
    """The API's errors name its fields (size_gib); the CLI says them as the options the user typed."""
    before = sorted(v["volume_id"] for v in vbs.all_volumes())
    cases = [(("create-volume", "--size", "999999"), "--size", "size_gib"),
             (("create-volume",), "--size (or --snapshot)", "size_gib"),
             (("create-volume", "--size", "1", "--type", "gp9"), "--type", "volume_type"),
             (("create-volume", "--snapshot", "snap-0123456789abcdef0"), "snap-0123456789abcdef0", "snapshot_id")]
    for args, said, unsaid in cases:
        r = run_cli(vbs, *args)
        assert r.returncode == 1 and said in r.stderr and unsaid not in r.stderr, (args, r.stderr)
    r = run_cli(vbs, "delete-volume", "vol-0123456789abcdef0")
    assert "InvalidVolume.NotFound" in r.stderr and "(hint: vbs describe-volumes lists" in r.stderr, r.stderr
    r = run_cli(vbs, "delete-snapshot", "snap-0123456789abcdef0")
    assert "InvalidSnapshot.NotFound" in r.stderr and "(hint: vbs describe-snapshots lists" in r.stderr, r.stderr
    r = run_cli(vbs, "describe-volumes", "--filter", "zone=a")
    assert r.returncode == 1 and "availability-zone" in r.stderr, r.stderr
    assert sorted(v["volume_id"] for v in vbs.all_volumes()) == before


def _volume(i: int) -> dict[str, Any]:
    return {"volume_id": f"vol-0123456789abcdef{i}", "size_gib": 10, "status": "available", "progress": 100,
            "snapshot_id": "snap-0123456789abcdef0", "storage_node": "storage-node-1", "pool": "default",
            "availability_zone": "us-east-1a", "volume_status": "ok",
            "attachments": [{"instance_id": "i-0123456789abcdef0", "vm_id": "vm1", "host": "host-1",
                             "device": "vdb", "state": "attached"}],
            "comment": "a volume with a long comment that takes room", "tags": {"team": "db", "env": "prod"},
            "created_at": "2026-11-24T01:02:03.456Z"}


@pytest.mark.unit
def test_a_table_fits_the_terminal_without_cutting_an_id_or_a_status() -> None:
    from rich.console import Console

    output.configure("table", None)
    console = Console(width=120, record=True, force_terminal=False)
    output.print_table(console, [_volume(i) for i in range(3)], output.VOLUME_COLUMNS)
    text = console.export_text()
    assert all(len(line) <= 120 for line in text.splitlines())
    assert "vol-0123456789abcdef1" in text and "available" in text and "availab…" not in text
    assert "10 GiB" in text and "host-1" in text  # size and attachment come next
    assert "hidden at this width" in text

    output.configure("table", None, "volumeid,Status,Tags")
    console = Console(width=120, record=True)
    output.print_table(console, [_volume(1)], output.VOLUME_COLUMNS)
    header = console.export_text().splitlines()[1]
    assert [h.strip() for h in header.strip("┃ ").split("┃")] == ["VolumeId", "Status", "Tags"]
    output.configure("table", None, "VolumeId,Nope")
    from vbs.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="no column Nope"):
        output.print_table(console, [_volume(1)], output.VOLUME_COLUMNS)
    output.configure("json", None)


@pytest.mark.integration
def test_named_profiles_give_the_endpoint_and_the_key(vbs: Vbs, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "vbs").mkdir(parents=True)
    (home / "vbs" / "config").write_text(f"[default]\nendpoint = http://127.0.0.1:1\n\n"
                                         f"[profile lab]\nendpoint = {vbs.endpoint}\n")
    (home / "vbs" / "credentials").write_text(f"[lab]\naws_access_key_id = {vbs.key.access_key_id}\n"
                                              f"aws_secret_access_key = {vbs.key.secret_access_key}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    env["XDG_CONFIG_HOME"] = str(home)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*VBS, *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)

    r = cli("describe-volumes", "--profile", "lab", "--output", "json")
    assert r.returncode == 0, r.stderr
    assert "volumes" in json.loads(r.stdout)
    r = cli("describe-volumes", "--output", "json")  # the default profile's endpoint: nobody there
    assert r.returncode == 1 and "127.0.0.1:1" in r.stderr, r.stderr
    r = cli("--profile", "nope", "describe-volumes")
    assert r.returncode == 1 and "no profile 'nope'" in r.stderr and "lab" in r.stderr, r.stderr
    (home / "vbs" / "credentials").write_text("[other]\n")
    r = cli("describe-volumes", "--profile", "lab")
    assert r.returncode == 1 and "no access key for profile 'lab'" in r.stderr, r.stderr


def test_region_picks_the_profiles_endpoint_and_must_be_the_controllers(vbs: Vbs, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "vbs").mkdir(parents=True)
    (home / "vbs" / "config").write_text(f"[default]\nendpoint = http://127.0.0.1:1\nregion = us-east-1\n"
                                         f"endpoint_us-east-1 = {vbs.endpoint}\n"
                                         f"endpoint_eu-west-1 = {vbs.endpoint}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    env.update(XDG_CONFIG_HOME=str(home), VBS_ACCESS_KEY_ID=vbs.key.access_key_id,
               VBS_SECRET_ACCESS_KEY=vbs.key.secret_access_key)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*VBS, *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)

    r = cli("describe-volumes", "--output", "json")  # the profile's region, and its endpoint for it
    assert r.returncode == 0 and "volumes" in json.loads(r.stdout), r.stderr
    r = cli("describe-volumes", "--region", "eu-west-1")  # an endpoint that serves another region
    assert r.returncode == 1 and "RegionMismatch" in r.stderr and "serves region us-east-1" in r.stderr, r.stderr
    r = cli("create-volume", "--size", "1", "--region", "eu-west-1")
    assert r.returncode == 1 and "RegionMismatch" in r.stderr
    r = cli("describe-volumes", "--region", "Not A Region")
    assert r.returncode == 2 and "--region" in r.stderr, r.stderr


def test_every_wait_shows_a_progress_bar_on_a_terminal(vbs: Vbs) -> None:
    """On a terminal (a pty here), --wait draws a bar with the time spent; piped, it prints only the answer."""
    import pty

    env = {**os.environ, "VBS_ENDPOINT": vbs.endpoint, "VBS_ACCESS_KEY_ID": vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key, "COLUMNS": "120", "TERM": "xterm"}

    def on_a_terminal(*args: str) -> str:
        parent, child = pty.openpty()
        proc = subprocess.Popen([*VBS, *args], env=env, stdin=child, stdout=child, stderr=child)
        os.close(child)
        out = b""
        while True:
            try:
                chunk = os.read(parent, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
        os.close(parent)
        return out.decode(errors="replace")

    made = on_a_terminal("create-volume", "--size", "1", "--wait")
    vol = next(w for w in made.replace("│", " ").split() if w.startswith("vol-"))
    assert "creating" in made and "100%" in made and "0:00:0" in made, made
    modified = on_a_terminal("modify-volume", vol, "--size", "2", "--wait")
    assert f"modifying {vol}" in modified and "100%" in modified, modified
    # A table like its siblings', with the real original figures (gp3's nominal 3000 IOPS, not "none").
    assert "1 GiB → 2 GiB" in modified and "3000" in modified and "{" not in modified, modified
    snapped = on_a_terminal("create-snapshot", vol, "--wait")
    assert "100%" in snapped and "snapshot snap-" in snapped, snapped
    deleted = on_a_terminal("delete-volume", vol, "--wait")
    assert f"deleting {vol}" in deleted, deleted
    piped = run_cli(vbs, "create-volume", "--size", "1", "--wait")
    assert piped.returncode == 0 and "%" not in piped.stderr and json.loads(piped.stdout)["status"] == "available"


@pytest.mark.integration
def test_shell_completion_is_offered() -> None:
    # typer detects the shell from the parent processes: the test runs vbs under bash (a suite started
    # outside any shell, from a service say, has none above it).
    r = subprocess.run(["bash", "-c", " ".join(shlex.quote(a) for a in [*VBS, "--show-completion"]) + "; exit $?"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "_vbs_completion" in r.stdout and "complete " in r.stdout, r.stderr


@pytest.mark.integration
def test_every_error_is_one_line_with_its_code_and_a_hint(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VBS_")}, "XDG_CONFIG_HOME": str(tmp_path)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*VBS, *args], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)

    r = cli("create-volume", "--sise", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: InvalidParameterValue: No such option: --sise") and \
        "(see: vbs create-volume --help)" in r.stderr
    r = cli("describe-volumes", "--endpoint", "http://127.0.0.1:1")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: AgentUnavailable:") and "(hint: is the controller running?" in r.stderr
